"""Batched rejection sampling for speculative decoding.

Speculative sampling (Leviathan et al., 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al., 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling") emits tokens distributed exactly as the
target would, whatever the proposer:

- the proposer drafts tokens x_1..x_k from its distribution q (the **draft tokens**);
- the target computes p at all k+1 positions in one forward pass;
- x_i is **accepted** with probability min(1, p_i(x_i) / q_i(x_i)), in order;
- at the first rejection a **recovered token** is drawn from
  normalize(max(0, p_i - q_i)) and the rest are discarded;
- if all k are accepted a **bonus token** is drawn from p_{k+1}.

p and q are the *processed* distributions (temperature, top-k, top-p, min-p).
A proposer without probabilities (n-gram lookup) is q = one-hot(x_i): accept
with probability p_i(x_i), recover from p_i with x_i removed. Greedy requests
take the exact-match path: accept while x_i == argmax p_i, then emit the argmax.
With k = 0 this is plain sampling, so the engine has a single sampling path.

Randomness comes from the generator passed for each request, drawn in a fixed
order (its own num_draft uniforms, then V exponentials; never the batch's padded
K), so a request's draws never depend on its batch. The engine passes a fresh
generator per step, keyed by the request's seed and the step's first output
index (``sampler.keyed_generator``), and sends only unseeded requests here: a
seeded request's tokens must not depend on its drafts (``verify``). Sampling from a
distribution uses the exponential race ``argmax(p / Exp(1))``: no cumulative
sums and no host synchronisation (pass num_draft as a host list on GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sample.sampler import exponential_noise, row_argmax


@dataclass
class RejectionOutput:
    token_ids: torch.Tensor     # [B, K+1] emitted tokens, -1 after the last emitted one
    num_accepted: torch.Tensor  # [B] accepted draft tokens (emitted = accepted + 1)


def rejection_sample(
    target_probs: torch.Tensor,          # [B, K+1, V] processed target distributions
    draft_token_ids: torch.Tensor,       # [B, K] (padding beyond num_draft is ignored)
    num_draft: torch.Tensor | list[int], # [B] draft tokens per request (0..K); a host list avoids a sync
    draft_probs: torch.Tensor | None,    # [B, K, V] processed draft distributions; None = one-hot proposer
    greedy: list[bool],                  # per request (a host list: no device sync to read it)
    generators: list[torch.Generator | None],  # per request; unused for greedy rows
) -> RejectionOutput:
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    device = target_probs.device
    counts = list(num_draft) if isinstance(num_draft, (list, tuple)) else num_draft.tolist()
    if not isinstance(num_draft, torch.Tensor):
        num_draft = torch.tensor(counts, dtype=torch.long).to(device, non_blocking=True)
    is_greedy = torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True)  # [B]
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_draft[:, None]                                  # [B, K]
    drafts = draft_token_ids.clamp(min=0)
    p_of_draft = target_probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)   # [B, K]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)        # [B, K]

    # Uniforms, then exponentials, from each request's generator (greedy rows draw nothing).
    uniforms = torch.zeros(batch, k, device=device)
    random_rows = [b for b in range(batch) if not greedy[b]]
    noise = torch.ones(batch, vocab, device=device)
    if random_rows:
        for b in random_rows:
            if counts[b]:
                uniforms[b, : counts[b]].uniform_(generator=generators[b])
        noise[random_rows] = exponential_noise(len(random_rows), vocab, [generators[b] for b in random_rows], device)

    argmax = row_argmax(target_probs)                                             # [B, K+1]
    accept_greedy = drafts == argmax[:, :k]
    accept_random = uniforms * q_of_draft < p_of_draft
    accepted = torch.where(is_greedy[:, None], accept_greedy, accept_random) & valid  # [B, K]
    num_accepted = accepted.int().cumprod(dim=-1).sum(dim=-1)                        # [B]

    # The distribution at the first non-accepted position: residual or bonus.
    p_next = target_probs[torch.arange(batch, device=device), num_accepted]          # [B, V]
    rejected_a_draft = num_accepted < num_draft
    if draft_probs is None:
        q_next = torch.zeros_like(p_next)
        rejected_token = drafts.gather(1, num_accepted.clamp(max=max(k - 1, 0)).unsqueeze(1)) if k else None
        if k:
            q_next.scatter_(1, rejected_token, 1.0)
    else:
        q_full = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, vocab)], dim=1)  # [B, K+1, V]
        q_next = q_full[torch.arange(batch, device=device), num_accepted]
    q_next = q_next * rejected_a_draft[:, None]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    sampled = row_argmax(residual / noise)                                      # [B]
    next_token = torch.where(is_greedy, argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1), sampled)

    out = torch.full((batch, k_plus_1), -1, dtype=torch.long, device=device)
    out[:, :k] = torch.where(accepted.int().cumprod(dim=-1).bool(), drafts, -1)
    out.scatter_(1, num_accepted.unsqueeze(1).long(), next_token.unsqueeze(1))
    return RejectionOutput(token_ids=out, num_accepted=num_accepted)
