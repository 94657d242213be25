"""dynamic_k's probes with a draft model (``engine.drafting``): a probe makes the draft catch
up on every token it has not seen, so it runs only where the tokens a request may still emit
could repay that (``DraftLengthPolicy.probe_pays``)."""
from __future__ import annotations

import dataclasses

import pytest

from specserve import LLM, SamplingParams
from specserve.spec_decode.proposer import Proposal

from dynamic_k_setup import REPEATING_PROMPTS as PROMPTS
from dynamic_k_setup import TINY_ENGINE_KW as KW
from dynamic_k_setup import catch_up_counts, pin_forward_costs

# A 55 ms step; at perfect acceptance 4 drafts make a token 49 ms; catching up costs 8 ms a row.
FORWARD = {1: 0.055, 2: 0.076, 3: 0.096, 4: 0.120, 5: 0.145}


def pinned_engine(tiny_llama_dir: str, tiny_draft_dir: str) -> LLM:
    llm = LLM(model=tiny_llama_dir, **KW, speculative_config={
        "model": tiny_draft_dir, "num_speculative_tokens": 4, "dynamic_k": True})
    pin_forward_costs(llm, FORWARD)
    policy = llm.engine.k_policy
    policy.draft.calibrate(first=0.030, later=0.023, per_catch_up_row=0.008)
    policy.record_draft = lambda *args: None
    return llm


@pytest.mark.parametrize("max_tokens, probes", [(40, False), (200, True)])
def test_a_request_probes_only_where_its_tokens_left_repay_the_catch_up(tiny_llama_dir, tiny_draft_dir,
                                                                        max_tokens, probes):
    """At step 16 the draft catches up the prompt and 16 tokens, ~20 past what one verification
    emits (0.16 s), and drafts 4 (0.1 s) with 4 more rows verified (0.09 s); saving at most 6 ms
    a token, 24 tokens left cannot repay that, 184 can.
    Without a probe nothing is drafted (no acceptance measured: the guess 0.5 does not pay);
    the answers are plain decoding's either way."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=tiny_llama_dir, **KW).generate(PROMPTS[:1], params,
                                                                                     use_tqdm=False)]
    llm = pinned_engine(tiny_llama_dir, tiny_draft_dir)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], params, use_tqdm=False)] == want
    drafted = llm.get_spec_decode_stats().num_draft_tokens
    assert (drafted > 0) == probes, drafted


def test_catch_up_tokens_are_what_the_draft_has_not_read(tiny_llama_dir, tiny_draft_dir, monkeypatch):
    """The whole prompt before the first proposal, then the bonus token and maybe the last draft."""
    llm = LLM(model=tiny_llama_dir, **KW, speculative_config={"model": tiny_draft_dir, "num_speculative_tokens": 3})
    (tokens, first), *later = seen = catch_up_counts(llm, monkeypatch, PROMPTS[0], max_tokens=12)
    assert first == tokens and later and all(1 <= n <= 2 for _, n in later), seen


def test_a_proposal_that_drafts_nothing_is_not_timed_as_drafting(tiny_llama_dir, tiny_draft_dir, monkeypatch):
    """An EAGLE head without the target's features for a request returns at once with no drafts:
    read as a draft's cost, that would make drafts look free."""
    llm = LLM(model=tiny_llama_dir, **KW, speculative_config={
        "model": tiny_draft_dir, "num_speculative_tokens": 3, "dynamic_k": True})
    policy, proposer = llm.engine.k_policy, llm.engine.proposer
    calibrated = dataclasses.astuple(policy.draft)
    monkeypatch.setattr(policy, "choose", lambda rates, limits, probe: list(limits))
    monkeypatch.setattr(proposer, "propose", lambda scheduled: Proposal(token_ids=[[] for _ in scheduled],
                                                                        probs=[None] * len(scheduled)))
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert dataclasses.astuple(policy.draft) == calibrated
