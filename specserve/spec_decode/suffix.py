"""Suffix decoding (arXiv 2411.04975, Arctic Inference's SuffixDecoding): no model, counts.

Two counting suffix tries, both bounded in depth:

- a **local** one per request, over its own prompt and output (what it quotes
  from itself), kept in a ``WeakKeyDictionary`` keyed by the request so it dies
  with it;
- a **global** one over recent requests (outputs, each primed with the last
  ``max_match`` tokens of its prompt so the start of an answer can match too):
  tokens move in as they are verified, so a finished request's output helps the
  next similar one. It holds at most ``max_cached_requests`` requests and
  ``max_cached_tokens`` tokens; the least recently used (the least recently
  extended) request is taken out first, its counts subtracted again.

A trie of depth D holds every substring of at most D tokens that occurred, with
its number of occurrences; ``total`` is how many of them were followed by a
token (the sum of the children's counts). Each step, for each request, the
longest suffix of its tokens (at most ``max_match`` = D - ``max_depth`` tokens)
that was seen followed by something is the match; below it, the continuation
t of a node s has the probability count(s t) / total(s), a path the product of
its tokens'. The draft tree is grown best first: the most probable node not yet
taken, until it holds min(k, ``max_spec_factor`` x the match length) tokens
(Arctic's rule: a short match is a weak hint), or the best left is below
``min_token_prob``, or nothing is left within ``max_depth`` tokens. The local
and the global trie each propose a tree; the one with the larger score (the sum
of its nodes' probabilities: the expected number of accepted tokens if the
counts are right) is kept. A tree that is a single path is proposed as a chain.

The tokens come out depth-first, most probable child first, so parents come
before children and the most probable path is drafts 0, 1, 2, ... (the layout
the engine verifies without moving any K/V when it is the one accepted).

Appending a token costs D dictionary steps per trie (one per open suffix):
incremental, pure Python. Memory: at most D nodes per cached token, far fewer on
repetitive text, where suffixes share nodes.
"""
from __future__ import annotations

import heapq
import weakref
from collections import OrderedDict

from specserve.core.request import Request
from specserve.core.scheduler import ScheduledRequest
from specserve.spec_decode.proposer import Proposal, Proposer

# Longest suffix matched against the tries; the tries' depth is max_match + max_depth.
DEFAULT_MAX_MATCH = 12
DEFAULT_MAX_CACHED_TOKENS = 1 << 16

# Nodes are integers and the trie lives in one dictionary of integers and a few lists of
# integers: no container per node, so the cyclic garbage collector never scans the nodes
# (with a list per node, a 2,000-token prompt took 100 ms instead of 15 ms, collections
# triggered by the new nodes scanning all the others, and every full collection anywhere
# in the process paid for them).
EDGE_BASE = 1 << 32    # edge key: parent * EDGE_BASE + token
ROOT = 0


class SuffixTrie:
    """Counting trie of every substring (of at most ``depth`` tokens) of the sequences added.

    A node n stands for a substring: ``count[n]`` its occurrences, ``total[n]`` how many
    of them were followed by a token (the sum of its children's counts). A sequence is
    extended token by token through its *cursor*: the nodes of its current suffixes of
    1 .. depth - 1 tokens, longest first (the ones that can still grow). ``remove``
    replays a sequence to subtract its counts; nodes left at 0 are freed for reuse.
    """

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.depth = depth
        self.root = ROOT
        self.edges: dict[int, int] = {}          # parent * EDGE_BASE + token -> child
        self.count = [0]
        self.total = [0]
        self.token = [-1]
        self.first_child = [-1]                  # children as a linked list, for walking them
        self.next_sibling = [-1]
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.count) - 1 - len(self._free)

    def new_cursor(self) -> list:
        return []

    def children(self, node: int):
        """(token, child) of every child of ``node``."""
        token, nxt = self.token, self.next_sibling
        child = self.first_child[node]
        while child >= 0:
            yield token[child], child
            child = nxt[child]

    def _new(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self.count[node] = self.total[node] = 0
            self.token[node] = token
            self.first_child[node] = -1
            self.next_sibling[node] = self.first_child[parent]
        else:
            node = len(self.count)
            self.count.append(0)
            self.total.append(0)
            self.token.append(token)
            self.first_child.append(-1)
            self.next_sibling.append(self.first_child[parent])
        self.first_child[parent] = node
        self.edges[parent * EDGE_BASE + token] = node
        return node

    def extend(self, cursor: list, tokens) -> list:
        """Add ``tokens`` to the sequence whose open suffixes are ``cursor``; -> the new cursor."""
        depth, edges, count, total = self.depth, self.edges, self.count, self.total
        keep = depth - 1
        for token in tokens:
            grown = []
            for parent in (*cursor, ROOT):   # longest suffix first, the root (empty suffix) last
                child = edges.get(parent * EDGE_BASE + token)
                if child is None:
                    child = self._new(parent, token)
                count[child] += 1
                total[parent] += 1
                grown.append(child)
            cursor = grown[-keep:] if keep else []
        return cursor

    def remove(self, tokens) -> None:
        """Subtract a sequence added (in one or several ``extend`` calls) before."""
        depth, edges, count, total = self.depth, self.edges, self.count, self.total
        keep = depth - 1
        cursor: list = []
        for token in tokens:
            grown = []
            for parent in (*cursor, ROOT):
                child = edges[parent * EDGE_BASE + token]
                count[child] -= 1
                total[parent] -= 1
                if count[child] == 0:   # nothing below it can be left either
                    self._delete(parent, child)
                else:
                    grown.append(child)
            # Suffixes whose node is gone have no longer ones left: the survivors stay aligned.
            cursor = grown[-keep:] if keep else []

    def _delete(self, parent: int, child: int) -> None:
        """Unlink ``child`` from ``parent`` and free its subtree."""
        nxt = self.next_sibling
        prev, node = -1, self.first_child[parent]
        while node != child:
            prev, node = node, nxt[node]
        if prev < 0:
            self.first_child[parent] = nxt[child]
        else:
            nxt[prev] = nxt[child]
        stack = [(parent, child)]
        while stack:
            p, n = stack.pop()
            del self.edges[p * EDGE_BASE + self.token[n]]
            c = self.first_child[n]
            while c >= 0:
                stack.append((n, c))
                c = nxt[c]
            self._free.append(n)

    def find(self, tokens) -> int | None:
        """The node of the substring ``tokens``, or None when it never occurred."""
        node = ROOT
        for token in tokens:
            node = self.edges.get(node * EDGE_BASE + token)
            if node is None:
                return None
        return node

    def longest_match(self, suffix, cursor: list | None = None) -> tuple[int, int | None]:
        """-> (n, node) for the longest tail of ``suffix`` (n tokens) seen followed by a token.

        ``cursor``: the open suffixes of the sequence ending in ``suffix``, if it was added
        to this trie (then no walk from the root is needed)."""
        length, total = len(suffix), self.total
        if cursor is not None:
            for n in range(min(length, len(cursor)), 0, -1):
                if total[cursor[-n]] > 0:
                    return n, cursor[-n]
            return 0, None
        for n in range(min(length, self.depth - 1), 0, -1):
            node = self.find(suffix[length - n:])
            if node is not None and total[node] > 0:
                return n, node
        return 0, None


def grow_tree(trie: SuffixTrie, node: int | None, k: int, max_depth: int,
              min_token_prob: float) -> tuple[list[int], list[int], float]:
    """The draft tree below ``node`` of ``trie``, best first -> (tokens, parents, score).

    Every candidate's probability is the product of count(child) / total(parent)
    along its path; the most probable one is taken until k tokens, or until the best
    left is below ``min_token_prob``; nothing deeper than ``max_depth``. Returned
    depth-first, most probable child first (parents before children). ``score``: the
    sum of the taken nodes' probabilities.
    """
    count, totals = trie.count, trie.total
    if k <= 0 or max_depth <= 0 or node is None or not totals[node]:
        return [], [], 0.0
    taken: list[tuple[float, int, int]] = []    # (prob, token, parent index in taken)
    heap: list = []
    tie = 0

    def push(parent_node: int, parent_index: int, prob: float, depth: int) -> None:
        nonlocal tie
        total = totals[parent_node]
        if depth > max_depth or not total:
            return
        for token, child in trie.children(parent_node):
            p = prob * count[child] / total
            if p >= min_token_prob:
                tie += 1
                heapq.heappush(heap, (-p, tie, token, child, parent_index, depth))

    push(node, -1, 1.0, 1)
    while heap and len(taken) < k:
        neg_p, _, token, child, parent_index, depth = heapq.heappop(heap)
        taken.append((-neg_p, token, parent_index))
        push(child, len(taken) - 1, -neg_p, depth + 1)
    if not taken:
        return [], [], 0.0
    # Depth first, most probable child first.
    children: dict[int, list[int]] = {}
    for i, (_, _, parent) in enumerate(taken):
        children.setdefault(parent, []).append(i)
    tokens, parents, new_index = [], [], {}
    stack = [(i, -1) for i in sorted(children.get(-1, []), key=lambda i: taken[i][0])]
    while stack:
        i, parent = stack.pop()
        new_index[i] = len(tokens)
        tokens.append(taken[i][1])
        parents.append(parent)
        stack.extend((j, new_index[i]) for j in sorted(children.get(i, []), key=lambda j: taken[j][0]))
    return tokens, parents, sum(p for p, _, _ in taken)


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


class _Local:
    """One request's state: its own trie, and its place in the global one."""

    __slots__ = ("trie", "cursor", "num_seen", "global_key", "global_cursor")

    def __init__(self, depth: int):
        self.trie = SuffixTrie(depth)
        self.cursor: list = []
        self.num_seen = 0           # tokens of all_token_ids added to the local trie
        self.global_key: int | None = None
        self.global_cursor: list = []


class GlobalSuffixCache:
    """The global trie over recent requests, least recently extended out first."""

    def __init__(self, depth: int, max_requests: int, max_tokens: int):
        self.trie = SuffixTrie(depth)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()   # key -> tokens added, LRU first
        self.num_tokens = 0
        self._next_key = 0

    def add_sequence(self) -> int:
        key = self._next_key
        self._next_key += 1
        self.sequences[key] = []
        self._evict(keep=key)
        return key

    def extend(self, key: int, cursor: list, tokens: list[int]) -> list | None:
        """-> the sequence's new cursor, or None when it was evicted (it is not extended then)."""
        seq = self.sequences.get(key)
        if seq is None:
            return None
        self.sequences.move_to_end(key)
        seq.extend(tokens)
        self.num_tokens += len(tokens)
        cursor = self.trie.extend(cursor, tokens)
        self._evict(keep=key)
        return cursor if key in self.sequences else None

    def _evict(self, keep: int) -> None:
        """Least recently extended first, ``keep`` last (it goes only if alone over the budget)."""
        while len(self.sequences) > self.max_requests or self.num_tokens > self.max_tokens:
            key = next(iter(self.sequences))
            if key == keep and len(self.sequences) > 1:
                key = next(k for k in self.sequences if k != keep)
            tokens = self.sequences.pop(key)
            self.num_tokens -= len(tokens)
            self.trie.remove(tokens)


class SuffixProposer(Proposer):
    drafts_are_free = True
    runs_beams = True

    def __init__(self, max_depth: int = 16, min_token_prob: float = 0.1, max_cached_requests: int = 256,
                 max_spec_factor: float = 1.0, max_match: int = DEFAULT_MAX_MATCH,
                 max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS):
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_match = max_match
        self.depth = max_match + max_depth
        self.global_cache = (GlobalSuffixCache(self.depth, max_cached_requests, max_cached_tokens)
                             if max_cached_requests > 0 else None)
        self.local: weakref.WeakKeyDictionary[Request, _Local] = weakref.WeakKeyDictionary()

    def _update(self, req: Request) -> _Local:
        """Add the request's new tokens to its own trie and (outputs) to the global one."""
        tokens = req.all_token_ids
        st = self.local.get(req)
        if st is None or st.num_seen > len(tokens):
            st = self.local[req] = _Local(self.depth)
        new = tokens[st.num_seen:]
        if not new:
            return st
        st.cursor = st.trie.extend(st.cursor, new)
        cache = self.global_cache
        if cache is not None:
            num_prompt = req.num_prompt_tokens
            if st.global_key is None and len(tokens) > num_prompt:
                # Its first output token(s): primed by the prompt's last tokens.
                st.global_key = cache.add_sequence()
                new = tokens[max(0, num_prompt - self.max_match):]
            elif st.global_key is None:
                new = []
            if st.global_key is not None and st.global_key >= 0 and new:
                cursor = cache.extend(st.global_key, st.global_cursor, new)
                if cursor is None:   # evicted: this request no longer feeds the global trie
                    st.global_key, cursor = -1, []
                st.global_cursor = cursor
        st.num_seen = len(tokens)
        return st

    def propose_one(self, req: Request, k: int) -> tuple[list[int], list[int] | None]:
        st = self._update(req)
        if k <= 0:
            return [], None
        tokens = req.all_token_ids
        suffix = tokens[-self.max_match:]
        best: tuple[list[int], list[int], float] = ([], [], 0.0)
        tries = [(st.trie, st.cursor)]
        if self.global_cache is not None:
            live = st.global_key is not None and st.global_key >= 0
            tries.append((self.global_cache.trie, st.global_cursor if live else None))
        for trie, cursor in tries:
            n, node = trie.longest_match(suffix, cursor)
            if node is None:
                continue
            budget = min(k, max(1, int(self.max_spec_factor * n)))
            tree = grow_tree(trie, node, budget, self.max_depth, self.min_token_prob)
            if tree[2] > best[2]:
                best = tree
        drafts, parents, _ = best
        return drafts, (None if is_chain(parents) else parents)

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        out = [self.propose_one(s.request, s.num_lookahead) for s in scheduled]
        return Proposal(token_ids=[t for t, _ in out], probs=[None] * len(out), parents=[p for _, p in out])
