"""Constrained sampling under speculation has plain constrained sampling's distribution.

A regex allows two of four letters at each of three positions, and a logit bias of +14 on the
four letters puts nearly all of the tiny models' mass on them, so about half of every
unconstrained distribution lies outside the grammar: the masks decide the distribution at
every position. Unseeded requests, so chains with a distribution go through the rejection
sampler; n-gram drafts from a prompt of the letters take the target's choices. The outcome is
the whole answer (8 strings); a chi-square test compares each proposer's answers with plain
decoding's. Proposers: the tiny draft model (masking its drafts), n-gram, and a scripted
proposer drawing every draft from a fixed q over the four letters that knows nothing of the
grammar, so its drafts are often invalid and its chains keep their first invalid draft, which
is rejected for certain and leaves the residual max(0, p - q) to sample.

Power: two verifiers that are wrong in ways that matter are caught. One leaves the draft rows
unmasked (only the first row of a step masked): its answers leave the grammar. The other is
subtler and keeps every answer valid: the scripted proposer's chains cut at their first
invalid token as one-hot chains may be, so the position is drawn from p instead of the
residual. At the second letter (the first drafted one: the first comes from the prompt's
step) p is about .6 "b" / .4 "c" and q puts .65 on "b", so the residual is "c" alone; after
an invalid draft (q's "a" and "d", .35) the cut draws "b" from p, and "b" rises from about
.6 to about .8.

Slow tier: 700 requests per distribution, six runs (about a minute on 2 cores).
"""
from __future__ import annotations

import pytest
import torch

import specserve.engine.constraints as constraints_module
import specserve.sample.verify as verify_module
from specserve import LLM, SamplingParams, StructuredOutput

from specserve.spec_decode.proposer import Proposal, Proposer

from chi_square import chi_square_p

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

LETTERS = {"a": 81, "b": 82, "c": 83, "d": 84}        # single-token letters of the default tokenizer
REGEX = "[ab][bc][cd]"
# Letters as single tokens, so n-gram lookup finds the answers' tokens in the prompt.
PROMPT = [LETTERS[c] for c in "abcbcdacdabdbbccddaacbccabc"]
N = 700


def params() -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=6, logit_bias={t: 14.0 for t in LETTERS.values()},
                          structured_output=StructuredOutput(regex=REGEX))


def make(model_dir, spec=None) -> LLM:
    extra = {"speculative_config": spec} if spec else {}
    return LLM(model=model_dir, dtype="float32", max_model_len=64, kv_cache_memory=16 << 20, max_num_seqs=128,
               seed=1234, **extra)


def answers(llm: LLM) -> list[str]:
    outs = llm.generate([PROMPT] * N, params(), use_tqdm=False)
    return [o.outputs[0].text if o.outputs[0].finish_reason == "stop" else "<invalid>" for o in outs]


Q = {"a": 0.3, "b": 0.65, "c": 0.0, "d": 0.05}


class FixedQ(Proposer):
    """Drafts every token from Q, whatever the context or the grammar (its own seeded generator)."""

    def __init__(self, vocab_size: int):
        self.q = torch.zeros(vocab_size)
        for letter, prob in Q.items():
            self.q[LETTERS[letter]] = prob
        self.gen = torch.Generator().manual_seed(99)

    def propose(self, scheduled) -> Proposal:
        tokens, probs = [], []
        for s in scheduled:
            n = s.num_lookahead
            tokens.append(torch.multinomial(self.q, n, replacement=True, generator=self.gen).tolist() if n else [])
            probs.append(self.q.expand(n, -1).clone() if n else None)
        return Proposal(tokens, probs)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return answers(make(tiny_llama_dir))


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tiny_draft_dir):
    # dynamic_k off: module fixtures are built before conftest's per-test default applies.
    fixed_q = make(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3, "grammar_drafts": False,
                                    "dynamic_k": False})
    fixed_q.engine.proposer = FixedQ(fixed_q.engine.vocab_size)
    return {
        "draft_model": make(tiny_llama_dir, {"method": "draft_model", "model": tiny_draft_dir,
                                             "num_speculative_tokens": 3, "grammar_drafts": False, "dynamic_k": False}),
        "ngram": make(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_adaptive": False,
                                       "grammar_drafts": False, "dynamic_k": False}),
        "fixed_q": fixed_q,
    }


def test_the_constraint_decides_the_answers(plain):
    """Sanity: every answer is in the language, and the letters are far from uniform."""
    assert all(len(a) == 3 and a[0] in "ab" and a[1] in "bc" and a[2] in "cd" for a in plain)
    assert 4 <= len(set(plain)) <= 8


@pytest.mark.parametrize("method", ["draft_model", "ngram", "fixed_q"])
def test_speculative_answers_have_plain_constrained_sampling_distribution(plain, engines, method):
    llm = engines[method]
    before = llm.get_spec_decode_stats()
    drafted, accepted = before.num_draft_tokens, before.num_accepted_tokens
    spec = answers(llm)
    stats = llm.get_spec_decode_stats()
    assert stats.num_draft_tokens - drafted > N / 2 and stats.num_accepted_tokens - accepted > N / 4
    assert "<invalid>" not in spec
    p = chi_square_p(plain, spec)
    assert p > 1e-3, (method, p)


def test_a_verifier_that_leaves_draft_rows_unmasked_is_caught(plain, engines, monkeypatch):
    real = verify_module.mask_verified_rows

    def first_row_only(reqs, logits):
        for r in reqs:
            if r.grammar is not None and r.grammar.step_bitmask is not None:
                mask = r.grammar.step_bitmask
                r.grammar.step_bitmask = torch.cat([mask[:1], torch.full_like(mask[1:], -1)])  # all allowed
        return real(reqs, logits)

    monkeypatch.setattr(verify_module, "mask_verified_rows", first_row_only)
    spec = answers(engines["draft_model"])
    assert chi_square_p(plain, spec) < 1e-6


def test_drafts_with_a_distribution_cut_as_one_hot_are_caught(plain, engines, monkeypatch):
    """Every answer stays valid (the target's rows are masked), yet the distribution is wrong."""
    real_fit = constraints_module._fit_chain

    def cut_as_one_hot(req, room):
        if req.draft_probs is not None:
            valid = req.grammar.valid_prefix(req.draft_token_ids)
            req.draft_token_ids, req.draft_probs = req.draft_token_ids[:valid], req.draft_probs[:valid]
            if not valid:
                req.draft_probs = None
        real_fit(req, room)

    monkeypatch.setattr(constraints_module, "_fit_chain", cut_as_one_hot)
    spec = answers(engines["fixed_q"])
    assert "<invalid>" not in spec
    assert chi_square_p(plain, spec) < 1e-6
