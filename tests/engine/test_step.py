"""One engine step, fast: the KV bookkeeping of a step (``Request.commit_step``), and on tiny
random models the paths that roll drafts back: rejected chains, trees of drafts (the accepted
branch's K/V copied into place), preemption while drafting, and logprobs under speculation.
Each compares speculative output with plain decoding token for token."""
from __future__ import annotations

import itertools

import pytest

from specserve import LLM, SamplingParams
from specserve.core.request import Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[200 + (i * 7919 + j * 104729) % 20000 for j in range(24)] for i in range(3)]   # no repeats
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _request(num_prompt: int = 8) -> Request:
    return Request("r", None, list(range(num_prompt)), SamplingParams(max_tokens=8), None, None)


def test_commit_step_advances_then_gives_back_the_rejected_drafts():
    req = _request()
    req.commit_step(8, None)                       # the prompt's prefill (no sample yet)
    assert req.num_computed_tokens == 8
    req.draft_token_ids, req.draft_parents = [5, 6, 7], None
    req.proposer_num_computed_tokens = 11          # the draft model computed its three drafts
    req.commit_step(1, num_accepted=1)             # last token + 3 drafts fed; 1 draft accepted
    assert req.num_computed_tokens == 8 + 1 + 1
    assert req.proposer_num_computed_tokens == 10  # clamped: the rejected drafts' K/V is stale
    assert req.draft_token_ids == [] and req.draft_parents is None and req.draft_probs is None


def test_commit_step_keeps_every_accepted_draft_and_discard_kv_resets():
    req = _request()
    req.commit_step(8, None)
    req.draft_token_ids = [1, 2]
    req.commit_step(1, num_accepted=2)
    assert req.num_computed_tokens == 11 and req.proposer_num_computed_tokens == 0
    req.draft_token_ids, req.proposer_num_computed_tokens = [3], 11
    req.discard_kv()
    assert (req.num_computed_tokens, req.proposer_num_computed_tokens, req.draft_token_ids) == (0, 0, [])


def wrong_second_guesses(llm):
    """Every other step, each chain's (or tree's) second draft token is made wrong, so the
    target rejects it: tiny random models settle into loops both models then guess right."""
    proposer, steps = llm.engine.proposer, itertools.count()
    real = proposer.propose

    def propose(scheduled):
        proposal = real(scheduled)
        if next(steps) % 2 == 0:
            for ids in proposal.token_ids:
                if len(ids) >= 2:
                    ids[1] = 300 + (ids[1] + 1) % 1000
        return proposal

    proposer.propose = propose
    return llm


def wrong_first_branch(llm):
    """Each chain of drafts becomes a tree whose first branch is a wrong token and whose second
    is the chain: when the chain is accepted, its K/V must be copied from the slots it was
    computed in down to its positions."""
    proposer = llm.engine.proposer
    real = proposer.propose

    def propose(scheduled):
        proposal = real(scheduled)
        parents = []
        for i, (s, ids) in enumerate(zip(scheduled, proposal.token_ids)):
            chain = ids[: s.num_lookahead - 1]
            if not chain:
                parents.append(None)
                continue
            proposal.token_ids[i] = [300 + (chain[0] + 1) % 1000] + chain
            parents.append([-1, -1] + list(range(1, len(chain))))
        proposal.parents = parents
        return proposal

    proposer.propose = propose
    return llm


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _llm(target, spec=None, **kw):
    kw = dict(dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20), **kw)
    return LLM(model=target, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain_tokens(tiny_llama_dir):
    return _tokens(_llm(tiny_llama_dir), PROMPTS, GREEDY)


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_tree": True},
], ids=["draft-chains", "ngram-trees"])
def test_rolled_back_drafts_leave_plain_output(tiny_llama_dir, tiny_draft_dir, plain_tokens, spec):
    if spec["method"] == "draft_model":
        spec = dict(spec, model=tiny_draft_dir)
    llm = wrong_second_guesses(_llm(tiny_llama_dir, spec))
    assert _tokens(llm, PROMPTS, GREEDY) == plain_tokens
    stats = llm.get_spec_decode_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens   # both kept and rejected drafts


def test_an_accepted_second_branch_is_copied_into_place(tiny_llama_dir):
    """Tokens alone barely notice a wrong K/V with a tiny random model; log-probabilities do."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    plain = _llm(tiny_llama_dir).generate(PROMPTS, params, use_tqdm=False)
    llm = wrong_first_branch(_llm(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 4}))
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_same_tokens_and_logprobs(plain, spec)
    stats = llm.get_spec_decode_stats()
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens >= 2 * stats.num_drafts > 0


def assert_same_tokens_and_logprobs(plain, spec):
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tid in la:
                assert la[tid].logprob == pytest.approx(lb[tid].logprob, abs=1e-5) and la[tid].rank == lb[tid].rank


def test_preemption_while_drafting_leaves_plain_output(tiny_llama_dir, tiny_draft_dir, plain_tokens):
    # 7 blocks of 16 tokens (2 layers x K and V x 2 heads x 16 x 16 float32 = 8 KiB a block) for three
    # requests of up to 24 + 24 + 3 tokens (4 blocks each): some are preempted and recomputed
    llm = wrong_second_guesses(_llm(tiny_llama_dir, {"method": "draft_model", "model": tiny_draft_dir,
                                                     "num_speculative_tokens": 3}, kv_cache_memory=7 * 8192, max_model_len=64))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_tokens
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_logprobs_under_speculation_are_the_plain_ones(tiny_llama_dir, tiny_draft_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    plain = _llm(tiny_llama_dir).generate(PROMPTS[:2], params, use_tqdm=False)
    spec = wrong_second_guesses(_llm(tiny_llama_dir, {"method": "draft_model", "model": tiny_draft_dir,
                                                      "num_speculative_tokens": 3})).generate(PROMPTS[:2], params,
                                                                                              use_tqdm=False)
    assert_same_tokens_and_logprobs(plain, spec)
