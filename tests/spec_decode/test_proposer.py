"""What every proposer shares (spec_decode/proposer.py)."""
from __future__ import annotations

from types import SimpleNamespace

from specserve import SamplingParams
from specserve.core.request import Request
from specserve.spec_decode.proposer import drafts_by_argmax


def _request(params: SamplingParams) -> Request:
    return Request("r", None, [1, 2, 3], params, None, 0)


def test_only_greedy_unadjusted_unmasked_requests_draft_by_argmax():
    assert drafts_by_argmax(_request(SamplingParams(temperature=0)))
    assert not drafts_by_argmax(_request(SamplingParams(temperature=0.7)))
    assert not drafts_by_argmax(_request(SamplingParams(temperature=0, repetition_penalty=1.3)))
    assert not drafts_by_argmax(_request(SamplingParams(temperature=0, logit_bias={5: 2.0})))
    constrained = _request(SamplingParams(temperature=0))
    constrained.grammar = SimpleNamespace()   # a structured-output request's matcher
    assert not drafts_by_argmax(constrained)
