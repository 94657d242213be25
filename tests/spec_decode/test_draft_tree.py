"""Draft-model trees (spec_decode/draft_tree.py) on tiny random models: greedy output is plain
output (chains of any tree size, both kinds of children, trees past 32 nodes), the accepted
branch's K/V lands in place in the target's and in the draft's caches (each check fails when that
move is skipped), preemption and prefix caching, and sampled output distributed as plain's."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model_executor.layers.attention import cache_slot

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[200 + (i * 7919 + j * 104729) % 20000 for j in range(24)] for i in range(3)]   # no repeats
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def _llm(model: str, spec: dict | None = None, **kw) -> LLM:
    return LLM(model=model, dtype="float32", max_model_len=160, kv_cache_memory=4 << 20, speculative_config=spec,
               **kw)


def _tree(draft: str, **tree) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "tree": tree}


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_tokens(tiny_llama_dir):
    return _tokens(_llm(tiny_llama_dir), PROMPTS, GREEDY)


@pytest.mark.parametrize("children", ["topk", "sampled"])
def test_greedy_trees_are_plain_output(tiny_llama_dir, tiny_draft_dir, plain_tokens, children):
    """A draft that mostly disagrees (tiny_draft_dir) and one that agrees (the target itself)."""
    for draft in (tiny_draft_dir, tiny_llama_dir):
        llm = _llm(tiny_llama_dir, _tree(draft, top_k=3, max_nodes=12, children=children))
        assert _tokens(llm, PROMPTS, GREEDY) == plain_tokens
        stats = llm.get_spec_decode_stats()
        assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > 2 * stats.num_drafts


def test_a_tree_of_more_than_32_nodes(tiny_llama_dir, plain_tokens):
    """48 nodes (top_k 4, 5 deep) are verified whole: the kernel's masks take as many words as
    the tree needs, nothing is clipped."""
    llm = _llm(tiny_llama_dir, _tree(tiny_llama_dir, top_k=4, max_nodes=48, max_depth=5))
    seen = []
    real = llm.engine.proposer.propose

    def propose(scheduled):
        proposal = real(scheduled)
        seen.extend(len(t) for t in proposal.token_ids)
        return proposal

    llm.engine.proposer.propose = propose
    assert _tokens(llm, PROMPTS, GREEDY) == plain_tokens
    assert max(seen) == 48      # the first steps: later ones have less room before max_tokens
    accepted = llm.get_spec_decode_stats().accepted_per_position
    assert len(accepted) >= 4 and accepted[3] > 0          # deep drafts accepted


def _assert_same_logprobs(a, b):
    """The same tokens, each with the same log-probability (to 1e-4)."""
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for token, la, lb in zip(x.outputs[0].token_ids, x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(la[token].logprob - lb[token].logprob) < 1e-4


def test_the_target_moves_the_accepted_branch_into_place(tiny_llama_dir, monkeypatch):
    """With the target as its own draft the deep branches are accepted, and every branch but the
    first sits in slots past its positions: the logprobs equal plain ones only if its K/V moves.
    Skipping the move (the negative control) changes them."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    plain = _llm(tiny_llama_dir).generate(PROMPTS, params, use_tqdm=False)
    spec = _llm(tiny_llama_dir, _tree(tiny_llama_dir, top_k=3, max_nodes=12)).generate(PROMPTS, params,
                                                                                     use_tqdm=False)
    _assert_same_logprobs(plain, spec)
    import specserve.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "tree_branch_moves", lambda path, last: [])
    skipped = _llm(tiny_llama_dir, _tree(tiny_llama_dir, top_k=3, max_nodes=12)).generate(PROMPTS, params,
                                                                                        use_tqdm=False)
    with pytest.raises(AssertionError):
        _assert_same_logprobs(plain, skipped)


def _draft_cache_errors(llm: LLM) -> list[float]:
    """Before each proposal: for every request, the largest difference between the draft's K/V and
    the target's at the positions the draft counts as computed (the draft IS the target here, so
    they agree wherever the draft's cache is right)."""
    engine, proposer = llm.engine, llm.engine.proposer
    errors: list[float] = []
    real = proposer.propose

    def propose(scheduled):
        for s in scheduled:
            r = s.request
            n = min(r.proposer_num_computed_tokens, r.num_computed_tokens)
            if n == 0:
                continue
            table = engine.kv_cache.block_table(r.request_id)
            slots = torch.tensor([cache_slot(table, p, engine.config.block_size) for p in range(n)])
            for target_layer, draft_layer in zip(engine.runner.kv_caches, proposer.runner.kv_caches):
                t = target_layer.view(2, target_layer.shape[1], -1, target_layer.shape[4])[:, :, slots]
                d = draft_layer.view(2, draft_layer.shape[1], -1, draft_layer.shape[4])[:, :, slots]
                errors.append(float((t - d).abs().max()))
        return real(scheduled)

    proposer.propose = propose
    return errors


def test_the_draft_moves_the_accepted_branch_into_place(tiny_llama_dir, monkeypatch):
    """The draft keeps the K/V of the accepted branch's expanded nodes (no recomputation): its cache
    then equals the target's at every position it counts as computed. Skipping the draft's move
    leaves another branch's K/V there."""
    llm = _llm(tiny_llama_dir, _tree(tiny_llama_dir, top_k=3, max_nodes=12))
    errors = _draft_cache_errors(llm)
    moved = []
    real_copy = llm.engine.proposer.runner.copy_kv_slots
    llm.engine.proposer.runner.copy_kv_slots = lambda src, dst: (moved.append(len(src)), real_copy(src, dst))
    _tokens(llm, PROMPTS, GREEDY)
    assert sum(moved) > 0 and max(errors) < 1e-4
    skipped = _llm(tiny_llama_dir, _tree(tiny_llama_dir, top_k=3, max_nodes=12))
    skipped_errors = _draft_cache_errors(skipped)
    skipped.engine.proposer.runner.copy_kv_slots = lambda src, dst: None
    _tokens(skipped, PROMPTS, GREEDY)
    assert max(skipped_errors) > 1e-2


def test_trees_under_preemption_and_prefix_caching(tiny_llama_dir, tiny_draft_dir, plain_tokens):
    """A KV cache too small for the three requests with their trees' lookahead slots: requests are
    preempted and recomputed; then the same prompts again hit the prefix cache. Plain output both times."""
    # 6 blocks of 16 tokens (2 layers x K and V x 2 heads x 16 x 16 float32 = 8 KiB a block)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=6 * 8192,
              speculative_config=_tree(tiny_llama_dir, top_k=3, max_nodes=8))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t[:24] for t in plain_tokens]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    cached = _llm(tiny_llama_dir, _tree(tiny_draft_dir, top_k=3, max_nodes=12))
    assert _tokens(cached, PROMPTS, GREEDY) == plain_tokens
    assert _tokens(cached, PROMPTS, GREEDY) == plain_tokens
    assert cached.engine.get_prefix_cache_stats()["hits"] > 0


def test_seeded_tree_samples_are_plain_samples(tiny_llama_dir, tiny_draft_dir):
    """Seeded requests take the target's keyed choices: with either kind of children, their tokens
    are plain sampling's with the same seeds."""
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    prompts = [PROMPTS[s % 3] for s in range(4)]
    plain = _tokens(_llm(tiny_llama_dir), prompts, params)
    for children in ("topk", "sampled"):
        llm = _llm(tiny_llama_dir, _tree(tiny_draft_dir, top_k=3, max_nodes=10, children=children))
        assert _tokens(llm, prompts, params) == plain


def test_dynamic_shapes_are_plain_output(tiny_llama_dir, tiny_draft_dir, plain_tokens):
    """tree.dynamic: every step's shape (chains of 2..4, trees of 6 and 12 nodes) is tried and
    measured; whichever is chosen, the output is plain output."""
    llm = _llm(tiny_llama_dir, _tree(tiny_draft_dir, top_k=3, max_nodes=12, dynamic=True))
    assert _tokens(llm, PROMPTS, GREEDY) == plain_tokens
    used = llm.engine.proposer.tree.shapes_used
    assert set(used) == {"chain:2", "chain:3", "chain:4", "tree:3/6/4", "tree:3/12/4"}


def test_a_narrow_tree_reaches_its_depth(peaked_llama_dir):
    """Tree 3/5, 4 deep: reaching depth 4 takes 3 expansions at each of depths 1-3, 9 nodes in
    the draft's cache for a tree of 5 (SpeculativeConfig.num_lookahead_slots reserves 9). A peaked
    model drafting for itself makes its likeliest paths deep, so drafts at depth 4 are proposed
    and accepted, the output is plain output, and the draft's cache, moved from slots past the
    tree's 5, equals the target's."""
    plain = _tokens(_llm(peaked_llama_dir), PROMPTS, GREEDY)
    llm = _llm(peaked_llama_dir, _tree(peaked_llama_dir, top_k=3, max_nodes=5))
    assert llm.engine.num_speculative_tokens == 9
    errors = _draft_cache_errors(llm)
    assert _tokens(llm, PROMPTS, GREEDY) == plain
    accepted = llm.get_spec_decode_stats().accepted_per_position
    assert len(accepted) == 4 and accepted[3] > 0
    assert max(errors) < 1e-4
