"""Token bitmasks: one bit per token id, 32 to an int32 word (llguidance's layout), and their
application to logits.

A bitmask row allows token t iff bit t % 32 of word t // 32 is set. Applying it sets the
forbidden tokens' logits to -inf, so every later step (penalties, temperature, top-k/p,
min-p, the argmax, the exponential race, rejection sampling) sees the constrained
distribution: exactly plain sampling's distribution restricted to the allowed tokens and
renormalized.
"""
from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def words_for(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, W] int32 -> allowed [R, vocab_size] bool."""
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                                # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (modified in place) with the tokens ``bitmask`` [R, W] forbids at -inf."""
    allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])   # [R, V]
    return logits.masked_fill_(~allowed, float("-inf"))


def is_allowed(bitmask_row: torch.Tensor, token_id: int) -> bool:
    """Whether one bitmask row [W] allows ``token_id``."""
    return bool((int(bitmask_row[token_id // 32]) >> (token_id % 32)) & 1)
