"""N-gram prompt lookup: no model, just the request's own tokens.

The longest suffix of the sequence (between ``min_n`` and ``max_n`` tokens)
that also occurs earlier in prompt + output proposes the tokens that followed
its most recent earlier occurrence: k of them, or with ``adaptive`` (the
default) min(k, n) for a suffix of n tokens: the chance that a quoted run
goes on grows with how much of it already matched, and every proposed token
costs a verified position. Replaying the default model's answers to 48
Spec-Bench summarization questions, this rule (k = 5) models 1.59x plain
decoding against 1.47x for a fixed k = 4 (docs/benchmarks.md, "n-gram draft
length"). Great for prompts whose answers quote
their input (summaries, code edits, extraction); proposes nothing otherwise,
which costs the engine nothing (a plain decoding step).

With ``tree`` (``prompt_lookup_tree``), the continuations of several earlier
occurrences are proposed at once as a tree of at most k tokens
(``ngram_tree``), and the target verifies every branch in the same forward.
"""
from __future__ import annotations

import numpy as np

from specserve.core.scheduler import ScheduledRequest
from specserve.spec_decode.proposer import Proposal, Proposer


def suffix_matches(tokens: np.ndarray, min_n: int, max_n: int) -> list[tuple[int, np.ndarray]]:
    """[(n, ends)] for every suffix length n in min_n..max_n that occurs earlier, shortest
    first: ``ends`` are the earlier positions (ascending) where those n tokens end."""
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return []
    # Earlier positions e whose token equals the last one: occurrences of the 1-token
    # suffix, ending at e. Then extend the survivors backwards one token at a time;
    # each position is compared once, where trying every n over every window would
    # compare n tokens at every position (0.6 ms against 0.02 ms at 300 tokens).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])   # [num_candidates], ascending
    levels = [(1, ends)] if len(ends) else []
    matched = 1
    while len(ends) and matched < max_n:
        longer = ends[ends >= matched]
        longer = longer[tokens[longer - matched] == tokens[length - 1 - matched]]
        if not len(longer):
            break
        ends, matched = longer, matched + 1
        levels.append((matched, ends))
    return [(n, e) for n, e in levels if n >= min_n]


def ngram_lookup(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int, adaptive: bool = False) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    tokens = np.asarray(tokens, dtype=np.int64)
    levels = suffix_matches(tokens, min_n, max_n) if k > 0 else []
    if not levels:
        return []
    matched, ends = levels[-1]
    start = int(ends[-1]) + 1  # token after the most recent occurrence of the longest suffix
    count = min(k, matched) if adaptive else k
    return tokens[start : start + count].tolist()


# A tree holds at most min(k, n + TREE_EXTRA_TOKENS) tokens for a longest match of n: the
# adaptive chain's min(k, n) plus room for alternatives. Replaying the default model's
# answers (docs/benchmarks.md, "n-gram trees"), 2 modelled best of 0-3 on both prompt sets.
TREE_EXTRA_TOKENS = 2


def ngram_tree(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int,
               extra: int = TREE_EXTRA_TOKENS) -> tuple[list[int], list[int]]:
    """Draft tokens as a tree: the continuations of several earlier occurrences.

    Occurrences of the longest matching suffix come first, then of shorter ones;
    within a length, the most recent first. Each offers the min(k, n) tokens that
    followed it (n: its suffix length, as the adaptive chain); they are merged into
    a prefix tree, node by node, until it holds min(k, n_max + extra) tokens
    (n_max: the longest match). The first branch is the chain
    ``ngram_lookup(..., adaptive=True)`` proposes, so a tree only adds alternatives.
    -> (tokens, parents): parents[i] is the index of token i's parent, -1 for the
    request's last token.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    levels = suffix_matches(tokens, min_n, max_n) if k > 0 else []
    if levels:
        k = min(k, levels[-1][0] + extra)
    drafts: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}   # (parent, token) -> node
    for n, ends in reversed(levels):
        depth = min(k, n)
        for end in ends[::-1].tolist():
            parent = -1
            for token in tokens[end + 1 : end + 1 + depth].tolist():
                node = node_of.get((parent, token))
                if node is None:
                    if len(drafts) == k:
                        return drafts, parents
                    node = node_of[(parent, token)] = len(drafts)
                    drafts.append(token)
                    parents.append(parent)
                parent = node
    return drafts, parents


class NgramProposer(Proposer):
    drafts_are_free = True
    runs_beams = True

    def __init__(self, min_n: int, max_n: int, adaptive: bool = True, tree: bool = False):
        self.min_n = min_n
        self.max_n = max_n
        self.adaptive = adaptive
        self.tree = tree

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        if self.tree:
            trees = [ngram_tree(s.request.all_token_ids, self.min_n, self.max_n, s.num_lookahead) for s in scheduled]
            return Proposal(token_ids=[t for t, _ in trees], probs=[None] * len(trees), parents=[p for _, p in trees])
        drafts = [ngram_lookup(s.request.all_token_ids, self.min_n, self.max_n, s.num_lookahead, self.adaptive) for s in scheduled]
        return Proposal(token_ids=drafts, probs=[None] * len(drafts))
