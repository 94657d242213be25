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


# Recursive rejection sampling down a tree of sampled drafts: the root's 3 children drawn from
# q_root without replacement, each child x's 2 children from q_after[x] without replacement.
RRS_VOCAB = 8


def _rrs_trials(p_root, p_after, q_root, q_after, trials: int, residual=None):
    """-> first tokens, and (first, second) pairs where the first was an accepted draft."""
    from specserve.sample.tree_sampler import recursive_residual, walk_tree_rejection

    residual = residual or recursive_residual
    firsts, pairs = [], []
    for _ in range(trials):
        kids = torch.multinomial(q_root, 3, replacement=False).tolist()
        tokens, parents, q_rows = list(kids), [-1, -1, -1], [q_root] * 3
        for i, x in enumerate(kids):
            grand = torch.multinomial(q_after[x], 2, replacement=False).tolist()
            tokens += grand
            parents += [i, i]
            q_rows += [q_after[x]] * 2
        target = torch.stack([p_root] + [p_after[t] for t in tokens])     # p at the root, then at each draft
        emitted, path = walk_tree_rejection(tokens, parents, target, torch.stack(q_rows), None, residual)
        firsts.append(emitted[0])
        if path:
            pairs.append((emitted[0], emitted[1]))
    return firsts, pairs


def _rrs_p_values(p_root, p_after, firsts, pairs) -> list[float]:
    def fit(samples, p):
        observed = torch.bincount(torch.tensor(samples), minlength=RRS_VOCAB).double()
        return stats.chisquare(observed.numpy(), (p.double() / p.double().sum() * len(samples)).numpy()).pvalue

    common = sorted(set(a for a, _ in pairs), key=lambda a: -sum(1 for x, _ in pairs if x == a))[:2]
    return [fit(firsts, p_root)] + [fit([b for a, b in pairs if a == x], p_after[x]) for x in common]


def _no_subtraction(p, q, rejected):
    """A wrong residual: the rejected token's mass zeroed in p, but q not subtracted."""
    p = p.clone()
    p[rejected] = 0
    q = q.clone()
    q[rejected] = 0
    return p / p.sum(), q / q.sum()


def test_recursive_rejection_sampling_emits_the_target_distribution():
    """8,000 verifications of freshly sampled trees (p and q differ at every node): the first
    emitted token is distributed as p at the root, and after an accepted draft x the next one as
    p after x (chi-square, p > 1e-4). A residual that only zeroes the rejected token (no p - q)
    fails the same test."""
    torch.manual_seed(0)
    p_root = torch.softmax(torch.randn(RRS_VOCAB) * 1.5, -1)
    q_root = torch.softmax(torch.randn(RRS_VOCAB) * 1.5, -1)
    p_after = torch.softmax(torch.randn(RRS_VOCAB, RRS_VOCAB) * 1.5, -1)
    q_after = torch.softmax(torch.randn(RRS_VOCAB, RRS_VOCAB) * 1.5, -1)
    firsts, pairs = _rrs_trials(p_root, p_after, q_root, q_after, 8_000)
    assert len(pairs) > 2_000
    assert min(_rrs_p_values(p_root, p_after, firsts, pairs)) > 1e-4
    torch.manual_seed(1)
    bad_firsts, bad_pairs = _rrs_trials(p_root, p_after, q_root, q_after, 6_000, _no_subtraction)
    assert _rrs_p_values(p_root, p_after, bad_firsts, bad_pairs)[0] < 1e-6


def test_recursive_rejection_accepts_an_identical_draft_always():
    """q == p: the first child is always accepted (min(1, p / q) = 1), down to the leaf."""
    p = torch.softmax(torch.randn(RRS_VOCAB), -1)
    from specserve.sample.tree_sampler import walk_tree_rejection

    emitted, path = walk_tree_rejection([3, 4, 1], [-1, -1, 0], p.repeat(4, 1), p.repeat(3, 1), None)
    assert path == [0, 2] and emitted[:2] == [3, 1] and len(emitted) == 3
