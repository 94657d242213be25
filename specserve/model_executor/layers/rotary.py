"""Rotary position embedding (the Hugging Face "rotate half" layout)."""
from __future__ import annotations

import torch
from torch import nn


def rope_theta_of(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise ValueError(f"unsupported rope type {rope_type!r}; specserve supports the default rotary embedding")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; ``lookup`` once per forward, ``apply`` per layer."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, hd/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, hd] in the model dtype (as the reference casts them)."""
        cos = self.cos[positions].repeat(1, 2).unsqueeze(1).to(dtype)
        sin = self.sin[positions].repeat(1, 2).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd] rotated by position: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
