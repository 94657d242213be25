"""What a free proposer's drafts would have earned, learned from the tokens the target emitted.

For a one-hot proposer (n-gram, suffix), the chance that its draft token at position i is
accepted is the chance that the target emits that token there: greedy verification accepts
exactly the target's argmax, and rejection sampling accepts a one-hot draft d with
probability p(d), the chance that a sample of the target is d (a rejected draft is never
resampled as d). So a proposal can be scored against the tokens the request then emits,
whether it was verified, cut short or not drafted at all. ``dynamic_k`` uses this for
proposers whose drafts cost nothing to compute: every step proposes the full K, the policy
verifies only the part that pays, and every proposal, verified or not, teaches the policy
its acceptance. No step has to draft in order to measure (no probes), so a request whose
drafts never pay costs plain decoding nothing but the lookup.

Counts are kept per proposal size: a proposal's size says much of its worth (n-gram's is
min(K, the matched suffix's length), and a long match is likelier to go on), so the policy
reads the rates of proposals of the size it has in hand.

Scores are per draft node: ``gain[i]`` is 1 when keeping nodes 0..i instead of 0..i-1 adds
an emitted token, i.e. node i lies on the branch the target followed. For a chain that is
"drafts 0..i all match"; for a tree (parents before children) it is the matched path.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from specserve.core.request import Request


def gains_by_node(tokens: list[int], parents: list[int] | None, emitted: list[int]) -> list[int]:
    """Per draft node, 1 if it is on the path the emitted tokens follow (see module docstring).

    ``emitted``: the tokens the request emitted from the first drafted position on (may be
    shorter than the drafts: the rest count as not emitted)."""
    gains = [0] * len(tokens)
    if parents is None:
        for i, token in enumerate(tokens):
            if i >= len(emitted) or emitted[i] != token:
                break
            gains[i] = 1
        return gains
    node, depth = -1, 0
    while depth < len(emitted):
        child = next((j for j in range(len(tokens)) if parents[j] == node and tokens[j] == emitted[depth]), None)
        if child is None:
            break
        gains[child] = 1
        node, depth = child, depth + 1
    return gains


def tree_depth(parents: list[int] | None, n: int) -> int:
    """How many emitted tokens can decide a proposal of n nodes: its deepest node's depth."""
    if parents is None:
        return n
    depths: list[int] = []
    for p in parents[:n]:
        depths.append(1 if p < 0 else depths[p] + 1)
    return max(depths, default=0)


@dataclass
class _Pending:
    start: int                   # index in all_token_ids of the token the first draft guesses
    tokens: list[int]
    parents: list[int] | None
    depth: int                   # emitted tokens needed to score it


@dataclass
class NodeCounts:
    """Per draft node: how many proposals had it, and how many of those it earned a token."""

    proposed: list[int] = field(default_factory=list)
    gained: list[int] = field(default_factory=list)

    def add(self, gains: list[int]) -> None:
        while len(self.proposed) < len(gains):
            self.proposed.append(0)
            self.gained.append(0)
        for i, g in enumerate(gains):
            self.proposed[i] += 1
            self.gained[i] += g

    def rates(self) -> list[float]:
        return [g / p if p else 0.0 for g, p in zip(self.gained, self.proposed)]


class ShadowDrafts:
    """Pending proposals per request, scored once the request has emitted enough tokens.

    ``engine(size)``: the counts of proposals of that size over all requests (the policy's
    prior); ``of(request, size)``: one request's own. State is per request and dies with it
    (a ``WeakKeyDictionary``)."""

    def __init__(self) -> None:
        self._engine: dict[int, NodeCounts] = {}
        self._pending: weakref.WeakKeyDictionary[Request, list[_Pending]] = weakref.WeakKeyDictionary()
        self._counts: weakref.WeakKeyDictionary[Request, dict[int, NodeCounts]] = weakref.WeakKeyDictionary()

    def engine(self, size: int) -> NodeCounts:
        return self._engine.setdefault(size, NodeCounts())

    def of(self, request: Request, size: int) -> NodeCounts:
        by_size = self._counts.get(request)
        if by_size is None:
            by_size = self._counts[request] = {}
        return by_size.setdefault(size, NodeCounts())

    def remember(self, request: Request, tokens: list[int], parents: list[int] | None) -> None:
        """A proposal for the positions after the request's current last token."""
        if tokens:
            self._pending.setdefault(request, []).append(
                _Pending(request.num_tokens, list(tokens), None if parents is None else list(parents),
                         tree_depth(parents, len(tokens))))

    def score(self, request: Request) -> None:
        """Score the request's proposals whose positions it has emitted (all of them once
        it has finished: positions never emitted earned nothing)."""
        pending = self._pending.get(request)
        if not pending:
            return
        done = request.is_finished()
        tokens = request.all_token_ids
        keep = []
        for p in pending:
            emitted = tokens[p.start : p.start + p.depth]
            gains = gains_by_node(p.tokens, p.parents, emitted)
            # Still open while every emitted token so far is on a branch: more may match.
            if len(emitted) < p.depth and not done and sum(gains) == len(emitted):
                keep.append(p)
                continue
            self.of(request, len(p.tokens)).add(gains)
            self.engine(len(p.tokens)).add(gains)
        self._pending[request] = keep
