"""``SamplingParams.prompt_logprobs``: every prompt token after the first gets its log-probability
under the tokens before it (and the top n), the model's own, however the prompt is computed: in
one step or in chunks, beside a prefix cache that holds it, under speculation, through a
preemption, and once for the n samples of a request. Tiny random models: seconds."""
from __future__ import annotations

import math

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.core import scheduler

from proposer_specs import PROPOSERS, proposer_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(37 * i + 11) % 5000 + 100 for i in range(45)]   # 45 tokens: two full blocks of 16 and a partial one


def make(model_dir, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 8 << 20)
    kw.setdefault("max_model_len", 256)
    return LLM(model=model_dir, dtype="float32", **kw)


def prompt_logprobs(llm, prompt=PROMPT, n_top=3, **params) -> list:
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=n_top, **params),
                         use_tqdm=False)
    return out.prompt_logprobs


def chosen(entries, prompt=PROMPT) -> list[float]:
    return [entries[i][tok].logprob for i, tok in enumerate(prompt) if i > 0]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """transformers' log-softmax of the whole prompt's logits, position p for token p + 1: [P - 1, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make(tiny_llama_dir)


def test_each_prompt_token_gets_the_models_log_probability_and_top_n(plain, reference):
    entries = prompt_logprobs(plain)
    assert len(entries) == len(PROMPT) and entries[0] is None
    want = reference.gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)
    assert chosen(entries) == pytest.approx(want.tolist(), abs=1e-4)
    top_lps, top_ids = reference.topk(3, dim=-1)
    for p, entry in enumerate(entries[1:]):
        ranked = sorted((e.rank, t) for t, e in entry.items() if e.rank is not None)
        assert [t for _, t in ranked] == top_ids[p].tolist()
        assert [entry[t].logprob for _, t in ranked] == pytest.approx(top_lps[p].tolist(), abs=1e-4)
        assert set(entry) == set(top_ids[p].tolist()) | {PROMPT[p + 1]}
        assert entry[PROMPT[p + 1]].decoded_token == plain.get_tokenizer().decode([PROMPT[p + 1]])


def test_zero_gives_the_prompt_tokens_alone_and_a_one_token_prompt_none(plain):
    entries = prompt_logprobs(plain, n_top=0)
    assert all(list(e) == [tok] for e, tok in zip(entries[1:], PROMPT[1:]))
    assert prompt_logprobs(plain, prompt=PROMPT[:1]) == [None]
    [out] = plain.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.prompt_logprobs is None


def test_chunks_and_the_per_step_cap_give_the_same_entries(tiny_llama_dir, plain, monkeypatch):
    want = chosen(prompt_logprobs(plain))
    chunked = make(tiny_llama_dir, max_num_batched_tokens=16)       # 16 + 16 + 13 prompt tokens
    assert chosen(prompt_logprobs(chunked)) == pytest.approx(want, abs=1e-5)
    monkeypatch.setattr(scheduler, "MAX_PROMPT_LOGPROB_CHUNK", 7)    # 7 a step: 7 steps for the prompt
    steps = []
    capped = make(tiny_llama_dir)
    original = capped.engine.runner.execute
    capped.engine.runner.execute = lambda inputs, **kw: steps.append([len(i.token_ids) for i in inputs]) or original(
        inputs, **kw)
    assert chosen(prompt_logprobs(capped)) == pytest.approx(want, abs=1e-5)
    assert [s[0] for s in steps[:7]] == [7] * 6 + [3]
    # the answer is the same as without prompt logprobs
    [a] = capped.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1), use_tqdm=False)
    [b] = capped.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_cached_prompt_is_computed_again_for_its_logprobs_and_its_samples_share_it(tiny_llama_dir):
    llm = make(tiny_llama_dir, enable_prefix_caching=True)
    want = prompt_logprobs(make(tiny_llama_dir, enable_prefix_caching=False))
    llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)      # the prompt's blocks now cached
    hits = llm.engine.get_prefix_cache_stats()["hits"]
    assert chosen(prompt_logprobs(llm)) == pytest.approx(chosen(want), abs=1e-5)
    assert llm.engine.get_prefix_cache_stats()["hits"] == hits             # no hit taken
    # n samples: the entries once, from the first; the other samples still hit the cache
    [out] = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=2),
                         use_tqdm=False)
    assert chosen(out.prompt_logprobs) == pytest.approx(chosen(want), abs=1e-5)
    assert llm.engine.get_prefix_cache_stats()["hits"] == hits + 2 * 32
    assert llm.engine.kv_cache.num_used_blocks() == 0


@pytest.mark.parametrize("spec", PROPOSERS)
def test_speculation_gives_plain_entries_and_tokens(tiny_llama_dir, tiny_draft_dir, tiny_eagle_dir, plain, spec):
    llm = make(tiny_llama_dir, speculative_config=proposer_config(spec, tiny_draft_dir, tiny_eagle_dir))
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2, logprobs=1)
    prompts = [PROMPT, PROMPT[:17], PROMPT[5:30]]     # 17: one prompt token left after a block (a drafted first token)
    got, want = llm.generate(prompts, params, use_tqdm=False), plain.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert chosen(g.prompt_logprobs, g.prompt_token_ids) == pytest.approx(
            chosen(w.prompt_logprobs, w.prompt_token_ids), abs=1e-5)


def test_a_preempted_request_keeps_one_entry_per_prompt_token(tiny_llama_dir, plain):
    want = chosen(prompt_logprobs(plain))
    # 4 requests of 45 + 60 tokens need 28 blocks; prompts in chunks of 16, so some are preempted
    # with part of their entries collected and computed again from their first token
    small = make(tiny_llama_dir, kv_cache_memory=14 * plain.engine.runner.bytes_per_block, max_model_len=128,
                 max_num_batched_tokens=16)
    assert small.engine.kv_cache.num_blocks == 14
    partial = []
    real_preempt = small.engine.scheduler._preempt
    small.engine.scheduler._preempt = lambda req, out: partial.append(req.needs_prompt_logprobs) or real_preempt(req, out)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=1)
    outs = small.generate([PROMPT] * 4, params, use_tqdm=False)
    assert any(partial) and not all(partial)    # preempted while collecting, and after
    for o in outs:
        assert len(o.prompt_logprobs) == len(PROMPT)
        assert chosen(o.prompt_logprobs) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "3", True])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_entries_are_probabilities(plain):
    for entry in prompt_logprobs(plain, n_top=5)[1:]:
        assert all(e.logprob <= 0 for e in entry.values())
        assert sum(math.exp(e.logprob) for e in entry.values() if e.rank is not None) <= 1 + 1e-6
