"""Bounds on SamplingParams and sampler numerics that cannot produce garbage:
every field is checked against what its tensor can hold, tiny temperatures are
greedy, tiny top_p keeps the most likely token, and zero noise cannot pick a
zero-probability token."""
from __future__ import annotations

import math

import pytest
import torch

from specserve.sample.rejection_sampler import rejection_sample
from specserve.sample.sampler import SamplingTensors, exponential_noise, processed_probs, sample_from_probs
from specserve.sampling_params import GREEDY_TEMPERATURE, MAX_SEED, SamplingParams

V = 50

BAD = [
    dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-1e-9), dict(temperature="1"),
    dict(temperature=True), dict(top_p=math.nan), dict(top_p=0.0), dict(top_p=1.0000001), dict(top_p=math.inf),
    dict(min_p=math.nan), dict(min_p=-0.1), dict(min_p=1.5),
    dict(top_k=10**20), dict(top_k=2**31), dict(top_k=-2), dict(top_k=1.5), dict(top_k=True),
    dict(seed=10**30), dict(seed=2**64), dict(seed=-1), dict(seed=-2**63 - 1), dict(seed=1.0), dict(seed=True),
    dict(seed=2**64, temperature=0), dict(seed=-5, temperature=0),
    dict(stop_token_ids=["a"]), dict(stop_token_ids=[True]), dict(stop_token_ids=[-1]), dict(stop_token_ids=[2**40]),
    dict(stop_token_ids=[1.0]), dict(stop_token_ids=7),
    dict(logprobs=True), dict(logprobs=1.5), dict(logprobs=21), dict(logprobs=-1),
    dict(n=0), dict(n=129), dict(n=True), dict(n=2.0), dict(max_tokens=True), dict(max_tokens=0), dict(max_tokens=2.0),
    dict(stop=[""]), dict(stop=[1]), dict(stop=5), dict(ignore_eos="yes"), dict(skip_special_tokens=None),
    dict(presence_penalty=2.5), dict(presence_penalty=math.nan), dict(frequency_penalty=-2.01),
    dict(frequency_penalty="1"), dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
    dict(repetition_penalty=math.inf), dict(repetition_penalty=11.0),
    dict(logit_bias=[1, 2]), dict(logit_bias={"5": 1.0}), dict(logit_bias={-1: 1.0}), dict(logit_bias={True: 1.0}),
    dict(logit_bias={5: 101.0}), dict(logit_bias={5: math.nan}), dict(logit_bias={5: "1"}),
    dict(logit_bias={i: 1.0 for i in range(2049)}),
]


@pytest.mark.parametrize("kwargs", BAD, ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_out_of_range_or_wrong_type_is_a_value_error(kwargs):
    with pytest.raises(ValueError, match="invalid SamplingParams"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(seed=0), dict(seed=MAX_SEED), dict(seed=2**63), dict(top_k=2**31 - 1), dict(top_k=0), dict(top_k=-1),
    dict(temperature=0), dict(temperature=1e-50), dict(top_p=1e-300), dict(stop_token_ids=[0, 2**31 - 1]),
    dict(logprobs=0), dict(logprobs=20), dict(min_p=1.0), dict(stop="x"), dict(n=64), dict(n=1),
    dict(presence_penalty=-2.0), dict(frequency_penalty=2), dict(repetition_penalty=10.0),
    dict(repetition_penalty=0.5), dict(logit_bias={0: -100, 2**31 - 1: 100.0}), dict(logit_bias={}),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_every_accepted_seed_seeds_a_generator():
    for seed in (0, 1, 2**63 - 1, 2**63, MAX_SEED):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


def test_temperatures_below_the_threshold_are_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-50).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    # Greedy rows are processed at temperature 1, so their probabilities stay finite.
    st = SamplingTensors.build([SamplingParams(temperature=1e-50)], V, torch.device("cpu"))
    assert st.temperature.tolist() == [1.0]


def _logits(rows=8, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4


def test_tiny_top_p_keeps_exactly_the_most_likely_token():
    """top_p = 1e-300 is 0.0 in float32; the top token must still survive (was: all -inf, NaN)."""
    logits = _logits()
    for top_p in (1e-300, 1e-45, 1e-9):
        st = SamplingTensors.build([SamplingParams(top_p=top_p)] * 8, V, torch.device("cpu"))
        probs = processed_probs(logits, st)
        assert torch.isfinite(probs).all()
        assert ((probs > 0).sum(dim=-1) == 1).all()
        assert torch.equal(probs.argmax(dim=-1), logits.argmax(dim=-1))
        gens = [torch.Generator().manual_seed(i) for i in range(8)]
        assert torch.equal(sample_from_probs(probs, gens), logits.argmax(dim=-1))


def test_smallest_random_temperature_is_finite_and_near_greedy():
    logits = _logits()
    st = SamplingTensors.build([SamplingParams(temperature=GREEDY_TEMPERATURE)] * 8, V, torch.device("cpu"))
    probs = processed_probs(logits, st)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(dim=-1), torch.ones(8))
    assert torch.equal(probs.argmax(dim=-1), logits.argmax(dim=-1))


def test_top_k_above_the_vocabulary_keeps_every_token():
    logits = _logits()
    huge = SamplingTensors.build([SamplingParams(top_k=2**31 - 1)] * 8, V, torch.device("cpu"))
    off = SamplingTensors.build([SamplingParams()] * 8, V, torch.device("cpu"))
    assert huge.top_k.tolist() == [V] * 8 and not huge.need_sort
    assert torch.equal(processed_probs(logits, huge), processed_probs(logits, off))


@pytest.fixture
def zero_noise(monkeypatch):
    """Every Exp(1) draw is exactly 0 (possible in principle; a NaN from 0/0 would win argmax)."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, generator=None: self.zero_())


def test_zero_noise_never_picks_a_zero_probability_token(zero_noise):
    noise = exponential_noise(2, V, [None, None], torch.device("cpu"))
    assert (noise > 0).all()
    probs = torch.zeros(2, V)
    probs[0, 7] = 1.0
    probs[1, [3, 9]] = 0.5
    tokens = sample_from_probs(probs, [None, None]).tolist()
    assert tokens[0] == 7 and tokens[1] in (3, 9)


def test_rejection_sampler_with_tiny_top_p_and_zero_noise(zero_noise):
    """The verification path gets the same guarantees: only the target's top token can come out."""
    logits = _logits(rows=6, seed=3)                                  # 2 requests x (2 drafts + 1)
    st = SamplingTensors.build([SamplingParams(top_p=1e-300, seed=1)] * 6, V, torch.device("cpu"))
    probs = processed_probs(logits, st).view(2, 3, V)
    best = logits.argmax(dim=-1).view(2, 3)
    wrong = (best + 1) % V                                            # drafts the target rejects
    drafts = torch.stack([best[0, :2], wrong[1, :2]])                 # request 0: both right; 1: both wrong
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    out = rejection_sample(probs, drafts, [2, 2], None, [False, False], gens)
    assert out.num_accepted.tolist() == [2, 0]
    assert out.token_ids[0].tolist() == best[0].tolist()
    assert out.token_ids[1].tolist() == [best[1, 0].item(), -1, -1]
