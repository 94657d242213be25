"""Trees of drafts from a model (a draft model or an EAGLE head), grown best first by EAGLE-2's rule.

Each decoding request's tree hangs under its last token (the root, at position ``last``). A
node's *score* is the cumulative draft probability of its path. Per request:

1. the root's distribution (from the proposer's catch-up forward) gives ``top_k`` candidate
   children;
2. each depth expands the ``top_k`` newest candidates of highest score: ONE batched draft
   forward over every request's expanded nodes, each attending to the cached context and its
   own ancestors only (tree attention over the draft's paged KV: ``ForwardInput.tree_cached``),
   so a shared prefix is computed once; each expanded node's distribution gives ``top_k``
   candidates more;
3. after ``max_depth`` depths the ``max_nodes`` best candidates, parents first, are the tree.

Children: "topk" takes a node's ``top_k`` likeliest tokens (verified by the target's choice at
every node: ``sample.tree_sampler.walk_tree``); "sampled" draws them from the draft's processed
distribution without replacement (the exponential race's order; verified by recursive
rejection sampling, ``walk_tree_rejection``, which needs the draft distribution ``q`` each was
drawn from: the Proposal's probs, one row per node, its parent's). In both, child r of a node
scores its parent's score times the r-th largest probability of the node's distribution, never
the drawn token's own probability: so whether a sampled child is kept depends on its rank and
on nodes ranked above it (ties broken by creation order, parents first), never on the values
drawn for it or its later siblings, and the kept children of a node are a prefix of its
without-replacement sample, which is what recursive rejection sampling needs to stay exact.
With "topk" the r-th likeliest token IS child r, so the score is its own cumulative probability.

The draft computes the K/V of expanded nodes only, in its own cache at slots last + 1, 2, ...
in the order it fed them (the target lays out the final tree in its node order instead).
``TreeRecord`` remembers where; ``keep_branch`` moves the accepted branch's K/V to positions
last + 1, ... once the target has verified, so the draft does not compute it again.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from specserve.config import TreeConfig
from specserve.core.request import Request
from specserve.sample.penalties import adjust_request_rows
from specserve.sample.sampler import CHOICE, SamplingTensors, exponential_noise, keyed_generator, processed_probs
from specserve.spec_decode.proposer import Proposal
from specserve.spec_decode.tree_policy import TreeShape, TreeSizePolicy, candidate_shapes
from specserve.structured_output.rows import mask_draft_rows


@dataclass
class TreeStep:
    """One request's share of a tree-growing draft forward."""

    index: int                 # the request's index in the batch
    token_ids: list[int]       # the nodes expanded now
    start_position: int        # their first slot: last + 1 + nodes fed before
    span_parents: list[int]    # parents over the tree's slots (root = the last token, 0), cached and new
    tree_cached: int           # tree slots already in the draft's cache (the root and nodes fed before)
    parent_slots: list[int]    # each new node's parent's tree slot (0: the root)


@dataclass
class _Node:
    token: int
    parent: int                # index into the request's nodes; -1 = the root
    depth: int                 # 1 for the root's children
    score: float               # log cumulative draft probability (by rank)
    dist: int                  # row of the request's distributions it was drawn from (its parent's)
    slot: int | None = None    # its tree slot in the draft's cache once expanded (slot = last + slot)


@dataclass
class _Growing:
    request: Request
    last: int                                  # position of the root (the request's last token)
    budget: int                                # nodes at most
    slots: int                                 # expanded nodes at most (the request's lookahead slots)
    nodes: list[_Node] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)   # [V] processed draft distributions
    slot_parents: list[int] = field(default_factory=lambda: [-1])   # per tree slot: its parent's slot

    def path(self, node: int) -> list[int]:
        tokens = []
        while node >= 0:
            tokens.append(self.nodes[node].token)
            node = self.nodes[node].parent
        return tokens[::-1]


@dataclass
class TreeRecord:
    """What the draft computed for one request's proposed tree (``keep_branch`` reads it)."""

    last: int                  # position of the root
    slots: list[int | None]    # per proposed node: its tree slot in the draft's cache, None if not expanded


class DraftTreeGrower:
    """Grows every decoding request's tree with a model's batched forwards (module docstring).

    ``forward(steps) -> logits [sum len(step.token_ids), V]`` runs the draft over the expanded
    nodes (tree attention); the proposer supplies it (its runner, or EAGLE's head)."""

    def __init__(self, tree: TreeConfig, depth: int, vocab_size: int):
        self.shape = TreeShape(tree.top_k, tree.max_nodes, tree.depth(depth))
        self.sampled = tree.children == "sampled"
        self.vocab_size = vocab_size
        self.records: weakref.WeakKeyDictionary[Request, TreeRecord] = weakref.WeakKeyDictionary()
        # tree.dynamic: each step's shape (a chain or a tree) by measured tokens per second
        self.policy = TreeSizePolicy(candidate_shapes(*self._shape_args())) if tree.dynamic else None
        self.shapes_used: dict[str, int] = {}     # str(shape) -> steps (dynamic only)

    def _shape_args(self) -> tuple[int, int, int]:
        return self.shape.top_k, self.shape.max_nodes, self.shape.max_depth

    def grow(self, reqs: list[Request], budgets: list[int], root_logits: torch.Tensor,
             forward: Callable[[list[TreeStep]], torch.Tensor], roots: list[int] | None = None) -> Proposal:
        """root_logits [B, V]: each request's draft logits after its last token (position
        ``num_computed_tokens``, already in the draft's cache); budgets: each request's lookahead
        slots (the draft's expanded nodes at most; its tree's nodes are at most these and
        ``max_nodes``) -> a tree per request.
        ``roots``: where each tree's root sits in the draft's cache if not at the last token's
        position (EAGLE's head computes position t from the token after it: one earlier)."""
        roots = roots or [r.num_computed_tokens for r in reqs]
        shape = self.shape
        if self.policy is not None:
            shape = self.policy.choose([r.request_id for r in reqs], [r.num_output_tokens for r in reqs], budgets)
            self.shapes_used[str(shape)] = self.shapes_used.get(str(shape), 0) + 1
        trees = [_Growing(r, root, min(b, shape.max_nodes), b) for r, root, b in zip(reqs, roots, budgets)]
        self._add_children(trees, [(i, -1) for i in range(len(trees)) if trees[i].budget > 0], root_logits,
                           shape.top_k)
        for depth in range(1, shape.max_depth):
            steps, expanded = [], []
            for i, t in enumerate(trees):
                fed = len(t.slot_parents) - 1
                room = min(shape.top_k, t.slots - fed)
                layer = [n for n, node in enumerate(t.nodes) if node.depth == depth]
                chosen = sorted(sorted(layer, key=lambda n: -t.nodes[n].score)[:max(room, 0)])
                if not chosen:
                    continue
                parent_slots = [0 if t.nodes[n].parent < 0 else t.nodes[t.nodes[n].parent].slot for n in chosen]
                for n, ps in zip(chosen, parent_slots):
                    t.nodes[n].slot = len(t.slot_parents)
                    t.slot_parents.append(ps)
                steps.append(TreeStep(i, [t.nodes[n].token for n in chosen], t.last + 1 + fed, list(t.slot_parents),
                                      1 + fed, parent_slots))
                expanded += [(i, n) for n in chosen]
            if not steps:
                break
            self._add_children(trees, expanded, forward(steps), shape.top_k)
        return self._finish(trees)

    def _add_children(self, trees: list[_Growing], expanded: list[tuple[int, int]], logits: torch.Tensor,
                      top_k: int) -> None:
        """Candidates under each expanded (request, node) from its row of ``logits`` [R, V]."""
        if not expanded:
            return
        if logits.shape[1] < self.vocab_size:   # a reduced draft vocabulary: the rest is never proposed
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[1]), value=float("-inf"))
        reqs = [trees[i].request for i, _ in expanded]
        paths = [trees[i].path(n) for i, n in expanded]
        params = [r.sampling_params for r in reqs]
        logits = adjust_request_rows(logits, reqs, [r.output_token_ids + p for r, p in zip(reqs, paths)])
        logits = mask_draft_rows(logits, reqs, paths)                                  # grammars
        probs = processed_probs(logits.float(), SamplingTensors.build(params, logits.shape[1], logits.device))
        k = min(top_k, probs.shape[1])
        ranked = _top(probs, k)                                                         # [R, k] values, tokens
        tokens = ranked.indices
        if self.sampled and not all(p.greedy for p in params):
            # Without replacement from q, in the race's order: top-k of q / Exp(1). Seeded requests
            # race with the noise of the token they guess (their tokens never depend on drafts);
            # the others, verified by rejection sampling, with fresh noise per node.
            gens = [keyed_generator(r.seed, r.num_output_tokens + len(p), CHOICE, logits.device)
                    if r.sampling_params.seed is not None else None for r, p in zip(reqs, paths)]
            raced = _top(probs / exponential_noise(probs.shape[0], probs.shape[1], gens, probs.device), k)
            sampled_rows = torch.tensor([not p.greedy for p in params], device=probs.device)
            tokens = torch.where(sampled_rows[:, None], raced.indices, tokens)
        rank_probs, tokens = ranked.values.tolist(), tokens.tolist()                   # the one host sync
        for row, (i, n) in enumerate(expanded):
            t = trees[i]
            t.dists.append(probs[row])
            parent_score = 0.0 if n < 0 else t.nodes[n].score
            depth = 1 if n < 0 else t.nodes[n].depth + 1
            for r in range(k):
                if rank_probs[row][r] <= 0.0:
                    break   # fewer than top_k tokens possible (top-k / top-p / a grammar)
                t.nodes.append(_Node(tokens[row][r], n, depth, parent_score + math.log(rank_probs[row][r]),
                                     len(t.dists) - 1))

    def _finish(self, trees: list[_Growing]) -> Proposal:
        """The ``budget`` best nodes of each tree, parents first -> Proposal (+ TreeRecords)."""
        token_ids, probs, parents = [], [], []
        for t in trees:
            # score first, then creation order: a node never ranks below a descendant
            kept = sorted(sorted(range(len(t.nodes)), key=lambda n: -t.nodes[n].score)[: t.budget])
            index = {n: j for j, n in enumerate(kept)}
            token_ids.append([t.nodes[n].token for n in kept])
            parents.append([-1 if t.nodes[n].parent < 0 else index[t.nodes[n].parent] for n in kept])
            wants_q = self.sampled and not t.request.sampling_params.greedy and kept
            probs.append(torch.stack([t.dists[t.nodes[n].dist] for n in kept]) if wants_q else None)
            self.records[t.request] = TreeRecord(t.last, [t.nodes[n].slot for n in kept])
        return Proposal(token_ids=token_ids, probs=probs, parents=parents)

    def keep_branch(self, request: Request, path: list[int], last: int,
                    copy_slots: Callable[[list[int], list[int]], None], slot_of: Callable[[int], int]) -> None:
        """The accepted ``path`` (node indices, root first) of the request's last tree: the K/V
        the draft computed for its leading expanded nodes moves to positions last + 1, ...
        (``copy_slots(src, dst)`` over cache slots, ``slot_of(position)``), and the draft's count
        of computed tokens covers them."""
        record = self.records.pop(request, None)
        if record is None or record.last != last or request.proposer_num_computed_tokens != last + 1:
            return   # not this proposer's tree, or its cache was given up since (preemption)
        kept = 0
        for node in path:
            if record.slots[node] is None:
                break
            kept += 1
        moves = [(last + record.slots[node], last + depth) for depth, node in enumerate(path[:kept], 1)
                 if record.slots[node] != depth]
        if moves:
            copy_slots([slot_of(src) for src, _ in moves], [slot_of(dst) for _, dst in moves])
        request.proposer_num_computed_tokens = last + 1 + kept


def _top(x: torch.Tensor, k: int):
    """x [R, V] -> its k largest per row (``.values``, ``.indices`` [R, k]), largest first. One
    child (a chain grown as a tree: the dynamic tree's chain steps) takes a max pass, the first
    of tied values as the chain proposer's argmax takes it; ``torch.topk`` costs about 3x that
    over a 152k vocabulary on a CPU (0.38 against 0.13 ms), whatever k."""
    return x.max(dim=-1, keepdim=True) if k == 1 else x.topk(k, dim=-1)
