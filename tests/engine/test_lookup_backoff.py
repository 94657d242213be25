"""dynamic_k's lookup back-off: requests whose proposals never pay are looked up every few steps."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.engine import drafting
from specserve.engine.drafting import CUTS_BEFORE_BACKOFF, LOOKUP_EVERY, LookupBackoff

from dynamic_k_setup import REPEATING_PROMPTS as PROMPTS
from dynamic_k_setup import TINY_ENGINE_KW as KW
from dynamic_k_setup import bare_request, pin_forward_costs


def test_cut_proposals_back_off_and_a_paying_one_comes_back():
    backoff, req = LookupBackoff(), bare_request([1, 2, 3])
    for _ in range(CUTS_BEFORE_BACKOFF - 1):
        assert not backoff.skips(req)
        backoff.chosen(req, proposed=3, kept=0)
    assert not backoff.skips(req)
    backoff.chosen(req, proposed=3, kept=0)                # the cut that starts the back-off
    assert [backoff.skips(req) for _ in range(LOOKUP_EVERY)] == [True] * (LOOKUP_EVERY - 1) + [False]
    backoff.chosen(req, proposed=2, kept=2)                # it pays again: looked up every step
    assert not backoff.skips(req) and not backoff.skips(req)


def test_no_proposal_is_no_reason_to_back_off():
    backoff, req = LookupBackoff(), bare_request([1, 2, 3])
    for _ in range(10):
        assert not backoff.skips(req)
        backoff.chosen(req, proposed=0, kept=0)


@pytest.mark.parametrize("lookup_share", [0.0, 1e9], ids=["lookups-costly", "lookups-cheap"])
def test_costly_rows_look_up_one_step_in_lookup_every(tiny_llama_dir, monkeypatch, lookup_share):
    """Rows so costly that nothing is ever verified: after the first cuts, each request is
    looked up once every LOOKUP_EVERY steps where lookups cost LOOKUP_SHARE of the forward
    (pinned here: any share, or none), every step where they cost less; the answers are
    plain decoding's either way."""
    monkeypatch.setattr(drafting, "LOOKUP_SHARE", lookup_share)
    plain = LLM(model=tiny_llama_dir, **KW)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(model=tiny_llama_dir, **KW,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": True})
    pin_forward_costs(llm, {1: 0.01, 2: 0.02, 3: 0.03})
    looked_up = []
    proposer = llm.engine.proposer
    real_propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda asked: looked_up.append(len(asked)) or real_propose(asked))
    decode_steps = []
    real_trim = llm.engine.drafting._propose_then_trim
    monkeypatch.setattr(llm.engine.drafting, "_propose_then_trim",
                        lambda p, decoding: decode_steps.append(len(decoding)) or real_trim(p, decoding))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
    assert llm.get_spec_decode_stats().num_draft_tokens == 0
    request_steps = sum(decode_steps)
    assert request_steps >= 3 * 35
    if lookup_share == 0.0:   # about 1 request-step in LOOKUP_EVERY is looked up
        assert sum(looked_up) < request_steps / LOOKUP_EVERY + 3 * (CUTS_BEFORE_BACKOFF + LOOKUP_EVERY)
    else:                     # every one
        assert sum(looked_up) == request_steps
