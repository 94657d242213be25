"""Logit bias and penalties: the formulas against a token-by-token reference, and the
draft tokens each verification row counts (chains and trees)."""
from __future__ import annotations

import pytest
import torch

from specserve.sample.penalties import adjust_each_row, adjust_logits, draft_histories
from specserve.sampling_params import SamplingParams

V = 12


def reference(logits: list[float], params: SamplingParams, prompt: list[int], history: list[int]) -> list[float]:
    """One row, one token at a time: bias, repetition (prompt + history), frequency, presence."""
    out = list(logits)
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        if t in prompt or t in history:
            rp = params.repetition_penalty
            out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
        count = history.count(t)
        out[t] -= params.frequency_penalty * count
        if count:
            out[t] -= params.presence_penalty
    return out


def test_chain_rows_count_the_drafts_before_them():
    assert draft_histories(0) == [[]]
    assert draft_histories(3) == [[], [0], [0, 1], [0, 1, 2]]


def test_tree_rows_count_their_ancestors():
    #        root
    #      /   |  \
    #     0    1   4
    #    / \
    #   2   3
    parents = [-1, -1, 0, 0, -1]
    assert draft_histories(5, parents) == [[], [0], [1], [0, 2], [0, 3], [4]]
    assert draft_histories(3, parents) == [[], [0], [1], [0, 2]]


@pytest.mark.parametrize("params", [
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(presence_penalty=0.5, frequency_penalty=1.25, repetition_penalty=1.3, logit_bias={0: 2.0, 5: -3.0}),
])
def test_adjusted_logits_match_the_reference(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3                  # both signs, for the repetition penalty
    prompt, output = [1, 2, 2], [5, 6, 5]
    extras = [[], [7], [7, 5], [7, 5, 1]]
    got = adjust_logits(logits, params, prompt, output, extras)
    for r in range(4):
        want = reference(logits[r].tolist(), params, prompt, output + extras[r])
        assert got[r].tolist() == pytest.approx(want, abs=1e-5), r
    assert logits.equal(torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 3)  # input untouched


def test_neutral_parameters_change_nothing():
    logits = torch.randn(2, V)
    params = SamplingParams()
    assert not params.adjusts_logits
    assert adjust_each_row(logits, [params, params], [[1], [2]], [[3], [4]]) is logits


def test_rows_of_different_requests_use_their_own_history():
    logits = torch.zeros(3, V)
    plain, freq = SamplingParams(), SamplingParams(frequency_penalty=1.0)
    out = adjust_each_row(logits, [freq, plain, freq], [[], [], []], [[4, 4], [4], [9]])
    assert out[0, 4] == -2.0 and out[0].sum() == -2.0
    assert out[1].abs().sum() == 0.0
    assert out[2, 9] == -1.0 and out[2].sum() == -1.0
