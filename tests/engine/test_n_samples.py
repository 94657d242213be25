"""n samples of one prompt (``SamplingParams(n=...)``): one output with n
completions, sample i equal to a lone request seeded seed + i, greedy samples equal,
the prompt computed once (its full blocks shared through the prefix cache, a draft
model's K/V in them too), and an
abort that ends every sample. Tiny random model: seconds."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from specserve import LLM, SamplingParams
from specserve.sampling_params import MAX_N
from specserve.engine.async_engine import AsyncLLMEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = list(range(200, 250))      # 50 tokens: 3 full blocks of 16
SPECS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3}}


def make(model_dir, spec="plain", caching=True) -> LLM:
    extra = {"speculative_config": SPECS[spec]} if SPECS[spec] else {}
    return LLM(model=model_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               enable_prefix_caching=caching, **extra)


def completions(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_seeded_samples_equal_lone_requests_with_seed_plus_i(tiny_llama_dir, spec, caching):
    llm = make(tiny_llama_dir, spec, caching)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10)
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.finished and all(c.finish_reason == "length" for c in out.outputs)
    alone = [llm.generate(PROMPT, dataclasses.replace(params, n=1, seed=7 + i), use_tqdm=False)[0].outputs[0].token_ids
             for i in range(4)]
    assert completions(out) == alone
    assert len(set(map(tuple, alone))) > 1             # really different samples
    assert llm.engine.kv_cache.num_used_blocks() == 0


def test_greedy_samples_are_identical(tiny_llama_dir):
    llm = make(tiny_llama_dir)
    [out] = llm.generate(PROMPT, SamplingParams(n=3, temperature=0.0, max_tokens=8), use_tqdm=False)
    want = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    assert completions(out) == [want] * 3


def test_the_prompt_is_computed_once(tiny_llama_dir):
    llm = make(tiny_llama_dir)
    llm.generate(PROMPT, SamplingParams(n=5, temperature=1.0, seed=0, max_tokens=4), use_tqdm=False)
    stats = llm.engine.get_prefix_cache_stats()
    assert stats["hits"] == 4 * 48                     # samples 2..5 reuse the prompt's 3 full blocks


def test_a_draft_model_reads_the_prompt_once_too(tiny_llama_dir, tiny_draft_dir):
    """The siblings start from the first sample's cached blocks before its draft has run; their
    drafts then start after the blocks its draft has computed since (``marked_tokens``), not at
    0, and the samples still equal lone requests."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
              speculative_config={"method": "draft_model", "model": tiny_draft_dir, "num_speculative_tokens": 3})
    proposer, starts = llm.engine.proposer, {}
    real = proposer._catch_up_start

    def catch_up_start(r):
        start = real(r)
        starts.setdefault(r.request_id, start)
        return start

    proposer._catch_up_start = catch_up_start
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    assert starts["0[0]"] == 0 and starts["0[1]"] == starts["0[2]"] == 48
    alone = [llm.generate(PROMPT, dataclasses.replace(params, n=1, seed=7 + i), use_tqdm=False)[0].outputs[0].token_ids
             for i in range(3)]
    assert completions(out) == alone


def test_samples_with_a_batch_of_other_requests(tiny_llama_dir):
    llm = make(tiny_llama_dir, "ngram")
    params = [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6), SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(n=2, temperature=0.0, max_tokens=6)]
    prompts = [PROMPT, PROMPT[:20], PROMPT[5:40]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 1, 2]
    for prompt, p, out in zip(prompts, params, outs):
        for i, c in enumerate(out.outputs):
            lone = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + i)
            assert c.token_ids == llm.generate(prompt, lone, use_tqdm=False)[0].outputs[0].token_ids


def test_aborting_a_request_ends_all_its_samples(tiny_llama_dir):
    llm = make(tiny_llama_dir)
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50))
    engine.step()                                       # sample 1 prefills; 2 and 3 are held back
    assert engine.has_unfinished_requests()
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_used_blocks() == 0 and not engine.groups and not engine.requests


def test_an_async_stream_carries_every_sample(tiny_llama_dir):
    llm = make(tiny_llama_dir)
    driver = AsyncLLMEngine.from_engine(llm)

    async def run():
        last = None
        async for out in driver.generate(PROMPT, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5)):
            assert len(out.outputs) == 2
            last = out
        return last

    try:
        last = asyncio.run(run())
    finally:
        driver.shutdown()
    assert last.finished and all(len(c.token_ids) == 5 for c in last.outputs)
    want = [llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3 + i, max_tokens=5),
                         use_tqdm=False)[0].outputs[0].token_ids for i in range(2)]
    assert completions(last) == want


def test_the_largest_n_the_api_allows_runs_every_sample(tiny_llama_dir):
    """n = 128 (the OpenAI API's limit, ``MAX_N``): every sample is a lone request seeded seed + i,
    in a KV cache too small for all of them at once (so some wait or are preempted)."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=1 << 19)
    assert llm.engine.kv_cache.num_blocks < MAX_N     # a block of its own per sample does not fit
    params = SamplingParams(n=MAX_N, temperature=1.0, seed=3, max_tokens=3)
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == list(range(MAX_N))
    for i in (0, 77, MAX_N - 1):
        alone = llm.generate(PROMPT, dataclasses.replace(params, n=1, seed=3 + i), use_tqdm=False)[0]
        assert out.outputs[i].token_ids == alone.outputs[0].token_ids
    assert llm.engine.kv_cache.num_used_blocks() == 0
