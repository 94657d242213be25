"""The beam search itself (engine/beam_search.py), over a fake language model: passes that
carry drafts (chains and trees, good and bad guesses) commit exactly plain beam search's
beams, order and scores, and more than one depth per pass when the drafts are right.
No model: milliseconds."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.beam_search_params import BeamSearchParams
from specserve.engine.beam_search import BeamSearchState, PassBeam

VOCAB = 12
EOS = 3


def fake_logits(context: tuple[int, ...]) -> torch.Tensor:
    """A deterministic 'model': the logits after ``context``, seeded by it ([VOCAB])."""
    g = torch.Generator().manual_seed(hash(context) & 0x7FFFFFFF)
    return torch.randn(VOCAB, generator=g) * 2.0


def run(params: BeamSearchParams, prompt: tuple[int, ...], drafter) -> tuple[list, int]:
    """A whole search, one pass at a time; ``drafter(context) -> (drafts, parents or None)``.
    -> (the finished hypotheses, the number of passes)."""
    state = BeamSearchState(params, EOS, params.max_tokens)
    running = [([], [], 0.0)]          # (tokens, logprobs, cum) per running beam
    passes = 0
    while True:
        passes += 1
        beams = []
        for tokens, lps, cum in running:
            ctx = prompt + tuple(tokens)
            drafts, parents = drafter(ctx)
            rows = [fake_logits(ctx)]
            for i in range(len(drafts)):   # the context of draft i: its path of drafts
                path, node = [], i
                while node != -1:
                    path.append(drafts[node])
                    node = parents[node] if parents is not None else node - 1
                rows.append(fake_logits(ctx + tuple(reversed(path))))
            beams.append(PassBeam(tokens, lps, cum, torch.stack(rows), drafts, parents))
        result = state.run_pass(beams)
        if result.done:
            return state.results(), passes
        assert all(len(nb.tokens) == result.depths and len(nb.nodes) == result.depths - 1 for nb in result.running)
        running = [(beams[nb.root].tokens + nb.tokens, beams[nb.root].logprobs + nb.logprobs, nb.cum_logprob)
                   for nb in result.running]


def no_drafts(ctx):
    return [], None


def greedy_chain(k):
    """The fake model's own greedy continuation: the top beam's path, rarely the others'."""
    def drafter(ctx):
        drafts = []
        for _ in range(k):
            drafts.append(int(fake_logits(ctx + tuple(drafts)).argmax()))
        return drafts, None
    return drafter


def top2_tree(depth):
    """A tree: the two likeliest tokens at every node, ``depth`` levels (2 + 4 + ... nodes)."""
    def drafter(ctx):
        drafts, parents, frontier = [], [], [(-1, ())]
        for _ in range(depth):
            nxt = []
            for node, path in frontier:
                for t in fake_logits(ctx + path).topk(2).indices.tolist():
                    drafts.append(t)
                    parents.append(node)
                    nxt.append((len(drafts) - 1, path + (t,)))
            frontier = nxt
        return drafts, parents
    return drafter


def random_guesses(seed, k):
    rng = random.Random(seed)

    def drafter(ctx):
        return [rng.randrange(VOCAB) for _ in range(rng.randrange(k + 1))], None
    return drafter


PARAMS = [
    BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.0),
    BeamSearchParams(beam_width=2, max_tokens=12, length_penalty=1.0, early_stopping=True),
    BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=2.0, early_stopping="never"),
    BeamSearchParams(beam_width=3, max_tokens=9, length_penalty=-0.5),
    BeamSearchParams(beam_width=1, max_tokens=10),
    BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"B{p.beam_width}-lp{p.length_penalty}-es{p.early_stopping}"
                         f"{'-ignore_eos' if p.ignore_eos else ''}")
def test_drafts_change_nothing_but_the_number_of_passes(params):
    saved = 0
    for seed in range(12):
        prompt = (seed % VOCAB, (7 * seed) % VOCAB, 5)
        plain, plain_passes = run(params, prompt, no_drafts)
        for drafter in (greedy_chain(3), top2_tree(2), random_guesses(seed, 4)):
            spec, passes = run(params, prompt, drafter)
            assert spec == plain          # tokens, each log-probability, cum_logprob, score: equal floats
            assert passes <= plain_passes
            saved += plain_passes - passes
    assert saved > 0                      # the drafts did commit several depths in one pass


def test_finished_hypotheses_and_early_stopping_are_exercised():
    """The fake model ends beams (EOS) and stops searches early: the cases the comparison above covers."""
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.0)
    reasons, short = set(), 0
    for seed in range(12):
        hyps, _ = run(params, (seed % VOCAB, (7 * seed) % VOCAB, 5), no_drafts)
        reasons |= {h.finish_reason for h in hyps}
        short += any(len(h.tokens) < params.max_tokens for h in hyps)
    assert reasons == {"stop", "length"} and short > 0


def test_a_pass_stops_at_the_first_depth_a_beam_leaves_its_drafts():
    """Two running beams; beam 0's chain is its own greedy path, beam 1's is wrong: one depth only."""
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    state = BeamSearchState(params, EOS, 10)
    ctx0, ctx1 = (1, 2), (1, 4)
    right = greedy_chain(3)(ctx0)[0]
    rows0 = torch.stack([fake_logits(ctx0 + tuple(right[:i])) for i in range(4)])
    wrong = [(int(fake_logits(ctx1).argmax()) + 1) % VOCAB] * 3
    rows1 = torch.stack([fake_logits(ctx1)] + [fake_logits(ctx1 + tuple(wrong[:i + 1])) for i in range(3)])
    result = state.run_pass([PassBeam([2], [-0.1], -0.1, rows0, right), PassBeam([4], [-0.2], -0.2, rows1, wrong)])
    assert result.depths == 1 and not result.done


def test_params_are_checked():
    for bad in ({"beam_width": 0}, {"beam_width": 2.0}, {"max_tokens": 0}, {"early_stopping": "sometimes"},
                {"early_stopping": 1}, {"length_penalty": float("nan")}, {"temperature": -1.0}):
        with pytest.raises(ValueError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
