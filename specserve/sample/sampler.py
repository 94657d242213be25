"""Logits -> processed probabilities -> tokens, seeded per request, no host sync.

"Processed" means temperature, top-k, top-p and min-p applied, in that order
(the order vLLM and transformers use). Both the target's and a draft's
distributions go through ``processed_probs`` so rejection sampling compares
like with like. Greedy rows (temperature 0) are processed at temperature 1;
their tokens come from the argmax, never from these probabilities.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors: one row per logits row."""

    temperature: torch.Tensor   # [N] (greedy rows hold 1.0)
    top_k: torch.Tensor         # [N] (vocab size where disabled)
    top_p: torch.Tensor         # [N]
    min_p: torch.Tensor         # [N]
    need_sort: bool             # any row uses top-k or top-p
    need_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> "SamplingTensors":
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            need_sort=any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p),
            need_min_p=any(m > 0 for m in min_p),
        )


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [N, V] fp32 -> probabilities [N, V] after temperature/top-k/top-p/min-p."""
    logits = logits / st.temperature.unsqueeze(1)
    if st.need_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)        # [N, V]
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= st.top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (keeps >= 1).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= st.top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if st.need_min_p:
        threshold = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def exponential_noise(num_rows: int, vocab_size: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[num_rows, V] Exp(1) noise; row i drawn from generators[i] (None: global RNG).

    ``argmax(p / E)`` with E ~ Exp(1) is a sample from p (the exponential race),
    which needs no cumulative sum and no host sync.
    """
    noise = torch.empty(num_rows, vocab_size, device=device)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    return noise


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs [N, V] -> tokens [N]."""
    noise = exponential_noise(probs.shape[0], probs.shape[1], generators, probs.device)
    return (probs / noise).argmax(dim=-1)
