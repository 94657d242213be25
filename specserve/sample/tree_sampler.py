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

A draft model's tree with children *sampled* from its distribution q (``spec_decode.draft_tree``,
children "sampled") is verified instead by recursive rejection sampling (``walk_tree_rejection``),
for unseeded sampled requests: at node v with target distribution p and children c_1..c_m drawn
from q without replacement, child c_i is accepted with probability min(1, p(c_i) / q(c_i)); on
a rejection p becomes the residual normalize(max(p - q, 0)) and q loses c_i (renormalized);
the walk moves into an accepted child, and after m rejections the next token is drawn from the
last residual (at a leaf: from p). This is SpecInfer's multi-draft rejection sampling with the
drafts drawn without replacement (Jeon et al., 2024, "Recursive Speculative Decoding"): each
emitted token is distributed as p exactly, and a rejected child's mass is 0 in every later
residual, so no sibling repeats it.
"""
from __future__ import annotations

import torch

from specserve.sample.sampler import choose_tokens, exponential_noise, row_argmax
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


def recursive_residual(p: torch.Tensor, q: torch.Tensor, rejected: int) -> tuple[torch.Tensor, torch.Tensor]:
    """After child ``rejected`` (drawn from q) was rejected under target p: (normalize(max(p - q, 0)),
    q without the rejected token, renormalized). p, q [V]."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum()
    residual = residual / mass if mass > 0 else p   # p == q: a rejection has probability 0
    q = q.clone()
    q[rejected] = 0.0
    q_mass = q.sum()
    return residual, (q / q_mass if q_mass > 0 else q)


def walk_tree_rejection(
    draft_tokens: list[int],
    parents: list[int],
    target_probs: torch.Tensor,          # [n + 1, V] processed p at the root, then at each draft
    draft_probs: torch.Tensor,           # [n, V] per draft, the q it was drawn from (its parent's)
    generator: torch.Generator | None,
    residual=recursive_residual,         # (p, q, rejected) -> (p, q) after a rejection
) -> tuple[list[int], list[int]]:
    """Recursive rejection sampling down a tree of sampled drafts (module docstring) ->
    (emitted tokens, accepted draft indices in path order). Random numbers come from
    ``generator`` in a fixed order: one uniform per child tried, one race per final draw."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    node, path, emitted = -1, [], []
    device = target_probs.device
    while True:
        p = target_probs[node + 1]
        kids = children.get(node, [])
        q = draft_probs[kids[0]] if kids else None
        accepted = None
        for child in kids:
            token = draft_tokens[child]
            u = torch.rand(1, generator=generator, device=device)
            if (u * q[token] < p[token]).item():
                accepted = child
                break
            p, q = residual(p, q, token)
        if accepted is None:
            noise = exponential_noise(1, p.shape[-1], [generator], device)[0].to(p.dtype)   # [V]
            emitted.append(int(row_argmax(p / noise)))
            return emitted, path
        emitted.append(draft_tokens[accepted])
        path.append(accepted)
        node = accepted
