"""Verification of trees of one-hot drafts: the walk, the target's choices, and the
statistical test that what is emitted is distributed as the target's p."""
from __future__ import annotations

import pytest
import torch
from scipy import stats

from specserve.sample.tree_sampler import target_choices, walk_tree
from specserve.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#        root
#       /    \
#     5(0)   7(1)
#     |   \     \
#    2(2)  3(3)  5(4)
TOKENS = [5, 7, 2, 3, 5]
PARENTS = [-1, -1, 0, 0, 1]


def test_walk_accepts_the_branch_the_target_chooses():
    # choices[0]: at the root; choices[1 + i]: at draft i.
    assert walk_tree(TOKENS, PARENTS, [7, 0, 5, 0, 0, 9]) == ([7, 5, 9], [1, 4])   # 7 -> 5 -> bonus 9
    assert walk_tree(TOKENS, PARENTS, [5, 3, 0, 0, 0, 0]) == ([5, 3, 0], [0, 3])   # 5 -> 3 -> bonus 0
    assert walk_tree(TOKENS, PARENTS, [5, 8, 0, 0, 0, 0]) == ([5, 8], [0])         # 5, then 8 recovers
    assert walk_tree(TOKENS, PARENTS, [4, 0, 0, 0, 0, 0]) == ([4], [])             # nothing accepted
    assert walk_tree([], [], [6]) == ([6], [])                                      # no drafts: plain
    assert walk_tree([1, 2, 3], [-1, 0, 1], [1, 2, 3, 4]) == ([1, 2, 3, 4], [0, 1, 2])  # a chain


def test_greedy_choices_are_the_argmax_and_draw_nothing():
    logits = torch.randn(6, 11)
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert target_choices(logits, [SamplingParams(temperature=0)] * 6, [gen] * 6) == logits.argmax(-1).tolist()
    assert torch.equal(gen.get_state(), state)


def test_seeded_choices_are_reproducible_and_follow_the_filters():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.9, top_k=3, seed=1)] * 2 + [SamplingParams(temperature=0)] * 2
    draws = []
    for _ in range(2):
        gens = [torch.Generator().manual_seed(5)] * 2 + [None, None]
        draws.append(target_choices(logits, params, gens))
    assert draws[0] == draws[1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(draws[0][i] in top3[i].tolist() for i in range(2))
    assert draws[0][2:] == logits[2:].argmax(-1).tolist()


def _emitted_pairs(probs: torch.Tensor, trials: int, choose) -> tuple[list[int], list[tuple[int, int]]]:
    """Run ``trials`` verifications of the tree; -> first tokens, (first, second) pairs
    where the first was accepted (so the second was chosen at that child)."""
    nodes = len(TOKENS) + 1
    logits = probs.log().repeat(trials, 1)                                  # [trials * nodes, V]
    choices = choose(logits, [SamplingParams(temperature=1.0)] * (trials * nodes), [None] * (trials * nodes))
    firsts, pairs = [], []
    for t in range(trials):
        emitted, path = walk_tree(TOKENS, PARENTS, choices[t * nodes:(t + 1) * nodes])
        firsts.append(emitted[0])
        if path:
            pairs.append((emitted[0], emitted[1]))
    return firsts, pairs


def _p_values(probs: torch.Tensor, firsts, pairs) -> list[float]:
    """Chi-square goodness of fit: first token vs p(root); second vs p(child) for each child."""
    vocab = probs.shape[1]
    def fit(samples, p):
        observed = torch.bincount(torch.tensor(samples), minlength=vocab).double()
        return stats.chisquare(observed.numpy(), (p.double() / p.double().sum() * len(samples)).numpy()).pvalue

    seconds = [[b for a, b in pairs if a == TOKENS[child]] for child in (0, 1)]  # the root's children: 5, 7
    return [fit(firsts, probs[0])] + [fit(seconds[c], probs[1 + c]) for c in (0, 1)]


def _biased_choices(logits, params, gens):
    """A deliberately wrong verifier: at the root, a draft child is taken whenever p gives it
    at least 5%, so the drafted tokens are emitted more often than p says."""
    choices = target_choices(logits, params, gens)
    probs = logits.softmax(-1)
    nodes = len(TOKENS) + 1
    for t in range(0, len(choices), nodes):
        for child_token in (5, 7):
            if probs[t, child_token] > 0.05 and torch.rand(()) < 0.5:
                choices[t] = child_token
    return choices


def test_emitted_tokens_follow_the_target_distribution():
    """60,000 tree verifications over a 12-token vocabulary, p drawn at random per node
    (every token with probability > 1%): the first emitted token is distributed as p at
    the root and, where a draft was accepted, the next one as p at that draft (chi-square,
    p > 1e-4 each). The same test rejects a verifier that over-accepts drafts."""
    torch.manual_seed(0)
    vocab = 12
    probs = torch.softmax(torch.randn(len(TOKENS) + 1, vocab), -1) * 0.88 + 0.01   # [nodes, V]
    firsts, pairs = _emitted_pairs(probs, 60_000, target_choices)
    assert len(pairs) > 5_000
    assert min(_p_values(probs, firsts, pairs)) > 1e-4
    torch.manual_seed(1)
    bad_firsts, bad_pairs = _emitted_pairs(probs, 20_000, _biased_choices)
    assert _p_values(probs, bad_firsts, bad_pairs)[0] < 1e-12
