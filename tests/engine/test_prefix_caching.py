"""Automatic prefix caching in the engine: the same greedy tokens and the
same seeded samples as without it (batch 1 and 8, plain, n-gram, a draft model
and EAGLE, under preemption), hit counts, and no block registered while it holds
a draft token awaiting verification, or, with EAGLE, before its head has
computed it. Tiny random model: seconds."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.core.kv_cache_manager import KVCacheManager
from specserve.core.request import Request

from cached_prefix_kv import kv_at_positions, prompts_parting_after_four_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SYSTEM = "You are a careful assistant. Answer briefly and quote the question back. " * 3
QUESTIONS = ["What is two plus two?", "Name a colour.", "one two three one two three", "Why is the sky blue?",
             "a b c a b c a b c", "Count to five.", "Say hello.", "the cat sat on the mat the cat sat"]
SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "draft": "draft",   # another tiny random model: a draft KV cache, and rejections
    "eagle": "eagle",   # a head whose K/V the cached blocks carry too
}
DRAFT_DIR: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _draft_dir(tiny_draft_dir, tiny_eagle_dir):
    DRAFT_DIR.update(draft=tiny_draft_dir, eagle=tiny_eagle_dir)


def make_llm(model_dir, spec: str, caching: bool, **kw) -> LLM:
    config = SPECS[spec]
    if config == "draft":
        config = {"method": "draft_model", "model": DRAFT_DIR["draft"], "num_speculative_tokens": 3}
    elif config == "eagle":
        config = {"method": "eagle", "model": DRAFT_DIR["eagle"], "num_speculative_tokens": 3}
    extra = {"speculative_config": config} if config else {}
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLM(model=model_dir, dtype="float32", max_model_len=256, enable_prefix_caching=caching, **extra, **kw)


def params_for(batch: int) -> list[SamplingParams]:
    """Greedy and seeded sampled requests, alternating."""
    return [SamplingParams(temperature=0.0, max_tokens=12) if i % 2 == 0 else
            SamplingParams(temperature=0.8, seed=100 + i, max_tokens=12) for i in range(batch)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("spec", list(SPECS))
def test_the_same_tokens_with_and_without_prefix_caching(tiny_llama_dir, spec):
    prompts = [SYSTEM + q for q in QUESTIONS]
    off = make_llm(tiny_llama_dir, spec, caching=False)
    on = make_llm(tiny_llama_dir, spec, caching=True)
    want_one = [tokens(off.generate(p, params_for(1)[0], use_tqdm=False))[0] for p in prompts[:3]]
    want_batch = tokens(off.generate(prompts, params_for(8), use_tqdm=False))
    # Batch 1, one after another: the second and later prompts find the system prompt cached.
    assert [tokens(on.generate(p, params_for(1)[0], use_tqdm=False))[0] for p in prompts[:3]] == want_one
    after_sequential = on.engine.get_prefix_cache_stats()["hits"]
    # (EAGLE computes the last matched block again: its head's K/V there reads the next token)
    shared_blocks = len(on.get_tokenizer().encode(SYSTEM)) // 16 - (spec == "eagle")
    assert after_sequential >= 2 * 16 * shared_blocks
    # Batch 8 (its prompts are now cached too), then the same batch again.
    assert tokens(on.generate(prompts, params_for(8), use_tqdm=False)) == want_batch
    assert tokens(on.generate(prompts, params_for(8), use_tqdm=False)) == want_batch
    assert on.engine.get_prefix_cache_stats()["hits"] > after_sequential
    assert on.engine.kv_cache.num_used_blocks() == 0


def test_the_same_tokens_under_preemption(tiny_llama_dir):
    """A pool of 20 blocks for 8 requests of ~60 tokens: requests are preempted, and come
    back to find their own blocks (outputs included) cached."""
    bytes_per_block = 2 * 16 * 2 * 16 * 4 * 2           # K+V, block 16, 2 KV heads, head dim 16, fp32, 2 layers
    prompts = [SYSTEM + q for q in QUESTIONS]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 8
    want = tokens(make_llm(tiny_llama_dir, "ngram", caching=False).generate(prompts, params, use_tqdm=False))
    small = make_llm(tiny_llama_dir, "ngram", caching=True, kv_cache_memory=20 * bytes_per_block)
    assert small.engine.kv_cache.num_blocks == 20
    outs = small.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == want
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert small.engine.get_prefix_cache_stats()["hits"] > 0


def test_an_identical_prompt_reuses_every_full_block_but_the_last_token(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, "plain", caching=True)
    prompt = list(range(100, 150))                    # 50 tokens: 3 full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False)
    assert llm.engine.get_prefix_cache_stats() == {"enabled": True, "queries": 50, "hits": 0, "hit_rate": 0.0}
    second = llm.generate(prompt, params, use_tqdm=False)
    stats = llm.engine.get_prefix_cache_stats()
    assert stats["hits"] == 48 and stats["queries"] == 100 and stats["hit_rate"] == 0.48
    assert tokens(first) == tokens(second)


@pytest.mark.parametrize("spec", ["plain", "eagle"])
def test_reset_prefix_cache_forgets_every_prefix_but_not_while_requests_run(tiny_llama_dir, spec):
    """vLLM's ``LLM.reset_prefix_cache``: afterwards an identical prompt hits nothing and gets the
    same tokens; while a request is unfinished it does nothing and says so (False)."""
    llm = make_llm(tiny_llama_dir, spec, caching=True)
    prompt = list(range(100, 150))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False)
    rid = llm.engine.add_request(prompt, params)
    assert llm.reset_prefix_cache() is False
    llm.engine.abort_request(rid)
    assert llm.reset_prefix_cache() is True
    hits = llm.engine.get_prefix_cache_stats()["hits"]
    again = llm.generate(prompt, params, use_tqdm=False)
    assert llm.engine.get_prefix_cache_stats()["hits"] == hits and tokens(again) == tokens(first)
    llm.generate(prompt, params, use_tqdm=False)   # cached anew
    assert llm.engine.get_prefix_cache_stats()["hits"] == hits + 48


@pytest.mark.parametrize("spec", ["ngram", "draft", "eagle"])
def test_no_block_is_registered_while_it_holds_an_unverified_draft_token(tiny_llama_dir, spec, monkeypatch):
    """Every call that registers blocks passes only tokens whose KV is final: at most
    num_tokens - 1 (the newest token is not computed yet), never a draft position, and
    registered blocks carry the request's own tokens. With a draft model or EAGLE, a block
    marked as holding the proposer's final K/V lies below the proposer's own count too."""
    llm = make_llm(tiny_llama_dir, spec, caching=True)
    engine = llm.engine
    assert engine.kv_cache.proposer_kv == {"draft": "from_tokens", "eagle": "from_features"}.get(spec)
    real = KVCacheManager.cache_full_blocks
    calls = []

    marks = []

    def checked(kv, request_id, token_ids, num_verified_tokens, num_proposer_tokens, root=None):
        n = 0
        # (with EAGLE, a request that finished this step registers its last blocks at the step's end)
        req = engine.requests.get(request_id) or next(r for r in engine._blocks_held if r.request_id == request_id)
        limit = req.num_computed_tokens if req.num_output_tokens == 0 else req.num_tokens - 1
        assert num_verified_tokens <= limit, (req, num_verified_tokens)
        assert token_ids is req.all_token_ids
        assert num_proposer_tokens == req.proposer_num_computed_tokens
        table = kv.block_table(request_id)
        marked_before = [b in kv._proposer_marks for b in table]
        assert root is None                          # no LoRA adapter: the base model's chain
        real(kv, request_id, token_ids, num_verified_tokens, num_proposer_tokens, root=root)
        final = min(num_verified_tokens, num_proposer_tokens)
        for i, block in enumerate(table):
            key = kv.cached_block_key(block)
            if key is not None and i < num_verified_tokens // kv.block_size:
                assert list(key[1]) == req.all_token_ids[i * kv.block_size : (i + 1) * kv.block_size]
            if block in kv._proposer_marks and not marked_before[i]:   # marked by this call
                assert key is not None and (i + 1) * kv.block_size <= final, (req, i, num_verified_tokens,
                                                                              num_proposer_tokens)
                n += 1
        marks.append(n)
        calls.append(drafts_in_step.get(request_id, 0))

    # the drafts of the step that is registering blocks (cleared by commit_step before it does)
    drafts_in_step = {}
    real_commit = Request.commit_step

    def commit(req, num_scheduled, num_accepted):
        drafts_in_step[req.request_id] = len(req.draft_token_ids)
        real_commit(req, num_scheduled, num_accepted)

    monkeypatch.setattr(Request, "commit_step", commit)
    monkeypatch.setattr(KVCacheManager, "cache_full_blocks", checked)
    prompts = [SYSTEM + q for q in QUESTIONS]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=30, ignore_eos=True)
              for i, t in enumerate([0.0, 1.0] * 4)]   # sampled rows: rejections happen
    llm.generate(prompts, params, use_tqdm=False)
    assert any(calls)                                # called in steps that verified drafts
    assert (sum(marks) > 0) == (spec != "ngram")     # the proposer's K/V was marked where it keeps one
    stats = engine.get_spec_decode_stats()
    assert stats.num_accepted_tokens > 0
    if spec == "draft":   # (the tiny model's n-gram drafts are all accepted)
        assert stats.num_draft_tokens > stats.num_accepted_tokens


def test_prefix_caching_can_be_turned_off(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, "plain", caching=False)
    prompt = list(range(100, 150))
    for _ in range(2):
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert llm.engine.get_prefix_cache_stats() == {"enabled": False, "queries": 0, "hits": 0, "hit_rate": 0.0}


def test_a_hit_skips_the_draft_models_kv_only_where_an_earlier_draft_computed_it(tiny_llama_dir):
    """The draft model's K/V rides in the cached blocks ("from_tokens", core/kv_cache_manager.py).
    One after another: A (prompt P) stops after its first token, before its draft ever runs; B
    (P again) finds the target's blocks but no draft K/V in them, so its draft starts at 0; C
    shares B's first 4 blocks, where B's draft has computed its K/V, and its draft starts after
    them. At B's and C's first drafts the draft's K/V at every position equals an uncached
    engine's."""
    prompt_b, prompt_c = prompts_parting_after_four_blocks()
    seen = {}
    for caching in (True, False):
        llm = make_llm(tiny_llama_dir, "draft", caching=caching)
        proposer = llm.engine.proposer
        assert llm.engine.kv_cache.proposer_kv == ("from_tokens" if caching else None)
        real = proposer.propose

        def propose(scheduled, proposer=proposer, real=real, caching=caching):
            starts = {s.request.request_id: s.request.proposer_num_computed_tokens for s in scheduled}
            out = real(scheduled)
            for s in scheduled:
                r = s.request
                if (caching, tuple(r.prompt_token_ids)) not in seen:
                    table = proposer.kv_cache.block_table(r.request_id)
                    kv = [kv_at_positions(c, table, r.num_computed_tokens, proposer.kv_cache.block_size)
                          for c in proposer.runner.kv_caches]
                    seen[caching, tuple(r.prompt_token_ids)] = (starts[r.request_id], kv)
            return out

        proposer.propose = propose
        for prompt, max_tokens in ((prompt_b, 1), (prompt_b, 6), (prompt_c, 6)):
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
    assert [seen[True, tuple(p)][0] for p in (prompt_b, prompt_c)] == [0, 64]
    for prompt in (prompt_b, prompt_c):
        for got, want in zip(seen[True, tuple(prompt)][1], seen[False, tuple(prompt)][1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
