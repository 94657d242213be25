"""Penalties and logit bias are lossless under speculation: with a draft
model and with n-gram drafts, seeded requests give plain sampling's tokens with the
same penalties (their tokens are the target's own choices, keyed by seed and output
index), and unseeded requests with the draft model's probabilities, which
go through rejection sampling, plain sampling's distribution. Each verification row
must count the draft tokens before it; the tests show they can tell when they are
ignored (vLLM's old behaviour with speculation).

Tiny random models (the target, and another as the draft) make this fast; a logit
bias of +14 on six tokens puts most of the mass on them, so the penalties
(strong ones, on tokens both in the prompt and in the output) decide which of
the six come next, and pairs of consecutive tokens show it. One of the six is a stop
token held back by min_tokens=3: it may only come 4th, so a row that miscounts the
drafts before it also misplaces that ban.
"""
from __future__ import annotations


import numpy as np
import pytest

import specserve.sample.verify as verify_module
from specserve import LLM, SamplingParams

from chi_square import pair_p_value

# slow: 1,200 seeded requests per distribution (about 90 s); the full suite runs them
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

FAVOURED = [1000, 1001, 1002, 1003, 1004, 1005]
# Every favoured token occurs in the prompt with others after it: n-gram lookup always finds a draft.
PROMPT = [50, 1000, 1001, 1002, 1003, 1004, 1005, 60, 1003, 1004, 1005, 1000, 70, 1001, 1002]
N = 1200


def params(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True,
                          logit_bias={t: 14.0 for t in FAVOURED}, repetition_penalty=1.3,
                          frequency_penalty=1.0, presence_penalty=0.5,
                          stop_token_ids=[FAVOURED[-1]], min_tokens=3)   # that token only as the 4th


def make(model_dir, spec=None) -> LLM:
    extra = {"speculative_config": spec} if spec else {}
    return LLM(model=model_dir, dtype="float32", max_model_len=64, kv_cache_memory=16 << 20, max_num_seqs=128, **extra)


def samples(llm: LLM, seeded: bool = True) -> list[list[int]]:
    """N requests seeded 0 .. N - 1, or unseeded (the engine's seed sequence)."""
    outs = llm.generate([PROMPT] * N, [params(s if seeded else None) for s in range(N)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return samples(make(tiny_llama_dir))


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tiny_draft_dir):
    return {
        "draft_model": make(tiny_llama_dir, {"method": "draft_model", "model": tiny_draft_dir, "num_speculative_tokens": 3}),
        # dynamic_k off: this module-scoped fixture is built before conftest's per-test fixed_k_unless_asked,
        # and on a random model the policy would cut every draft (there would be nothing to verify).
        "ngram": make(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_adaptive": False,
                                       "dynamic_k": False}),
    }


def test_the_penalties_decide_the_pairs(plain):
    """Sanity: nearly all tokens are favoured ones, and a token rarely follows itself."""
    tokens = [t for s in plain for t in s]
    assert np.mean([t in FAVOURED for t in tokens]) > 0.75
    assert all(FAVOURED[-1] not in s[:3] for s in plain) and any(s[3:] == [FAVOURED[-1]] for s in plain)
    repeats = np.mean([s[i] == s[i + 1] for s in plain for i in range(3)])
    assert repeats < 0.08   # 1/6 without penalties


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seeded_samples_are_plain_samples(plain, engines, method):
    llm = engines[method]
    before = llm.get_spec_decode_stats().num_draft_tokens
    spec = samples(llm)
    stats = llm.get_spec_decode_stats()
    assert stats.num_draft_tokens - before > N            # tokens 2 and 3 came as drafts ...
    assert stats.num_accepted_tokens > N / 10             # ... and were often accepted
    assert spec == plain                                  # the same seeds: plain sampling's tokens


def test_rejection_sampled_pairs_match_plain_sampling(plain, engines):
    llm = engines["draft_model"]
    before = llm.get_spec_decode_stats().num_accepted_tokens
    spec = samples(llm, seeded=False)
    assert llm.get_spec_decode_stats().num_accepted_tokens - before > N / 10
    for at in (1, 2):                                      # (t2, t3): draft after draft; (t3, t4): bonus after drafts
        p = pair_p_value(plain, spec, at)
        assert p > 1e-3, (at, p)


def test_ignoring_the_drafts_before_a_row_is_detected(plain, engines, monkeypatch):
    """Power: if each row counted only the output before the step (not the accepted drafts
    before it), seeded samples would not be plain's, and the pairs of rejection-sampled ones
    would differ from plain sampling's: the tests above say so."""
    monkeypatch.setattr(verify_module, "draft_histories", lambda n, parents=None: [[] for _ in range(n + 1)])
    seeded = samples(engines["draft_model"])
    assert np.mean([a == b for a, b in zip(seeded, plain)]) < 0.9
    spec = samples(engines["draft_model"], seeded=False)
    assert min(pair_p_value(plain, spec, 1), pair_p_value(plain, spec, 2)) < 1e-6
