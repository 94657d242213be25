"""Verifying a tree of one-hot drafts: the target picks a token at every node, then the tree is walked.

A proposer without probabilities (n-gram lookup) may offer several
continuations at once as a tree: draft tokens with parents, the root being the
request's last token. The target computes its distribution p at every node in
one forward pass (each node attends to its ancestors only). Then:

- at every node v the target's own choice y_v is drawn: argmax p_v for greedy
  requests, else a sample from the processed p_v (the exponential race, with
  the noise of the output index that v's choice decides: the request's
  ``keyed_generator(seed, index, CHOICE)``, so nodes at one depth share it);
- starting at the root, while some child of the current node carries the
  token y_v, that child is **accepted** and becomes the current node;
- the choice at the last node reached is emitted after the accepted tokens
  (the recovered or bonus token).

Every emitted token is the target's own choice given the tokens before it, so
the output is distributed exactly as plain decoding (for one-hot drafts, this
is what rejection sampling with q = one-hot does along one branch: accept x
with probability p(x), else draw from p without x). Greedy output is the plain
argmax sequence token for token. Nodes at one depth share their noise, which
is harmless: the walk reaches one node per depth, chosen by the noise of the
depths above it, so the noise at that node is still fresh.

Because the noise depends only on the output index, the emitted tokens are
those plain decoding draws with the same keyed noise, whatever was drafted,
however many drafts there were, and whichever proposer drafted them: a seeded
request gives the same tokens with any proposer and k, alone or batched, and
after a preemption. Drafts decide only how many tokens one forward verifies.
"""
from __future__ import annotations

import torch

from specserve.sample.sampler import choose_tokens
from specserve.sampling_params import SamplingParams


def target_choices(
    logits: torch.Tensor,                       # [R, V] the target's logits at every node of every tree
    row_params: list[SamplingParams],           # [R] each row's request's parameters
    row_generators: list[torch.Generator | None],  # [R] each row's generator (the engine's: keyed by output index)
) -> list[int]:
    """The target's token at every row: argmax for greedy rows, a sample elsewhere (one host sync)."""
    return choose_tokens(logits, row_params, row_generators).tokens


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each draft (1 for the root's children); parents come before their children."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def walk_tree(draft_tokens: list[int], parents: list[int], choices: list[int]) -> tuple[list[int], list[int]]:
    """-> (emitted tokens, accepted draft indices in path order).

    draft_tokens[i] hangs under draft parents[i] (-1 = the root); choices[0] is the
    target's choice at the root and choices[1 + i] at draft i.
    """
    children: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(draft_tokens, parents)):
        children.setdefault((parent, token), i)   # a repeated sibling token: the first one counts
    node, path, emitted = -1, [], []
    while True:
        token = choices[node + 1]
        emitted.append(token)
        child = children.get((node, token))
        if child is None:
            return emitted, path
        path.append(child)
        node = child
