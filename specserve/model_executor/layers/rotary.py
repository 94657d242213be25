"""Rotary position embedding (the Hugging Face "rotate half" layout), every rope type as
transformers computes it.

The frequencies come from transformers' own RoPE functions (``ROPE_INIT_FUNCTIONS``:
``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3``; ``default`` is the plain
``base ** (-2i / dim)``), so a scaled config gives the reference's numbers, including the
``attention_scaling`` factor yarn and longrope multiply cos and sin by, and
``partial_rotary_factor`` (only the first ``rotary_dim`` of each head's dims rotate; Phi-3).

Two rope types change with the length of the sequence in transformers, which recomputes
its frequencies per forward from the longest position it sees; a KV cache cannot follow
that (cached keys keep the rotation they were written with), so a table per position is
used instead:

- ``longrope`` (Phi-3): positions below ``original_max_position_embeddings`` use the short
  factors, positions at or past it the long ones (as vLLM does). Equal to transformers for
  every sequence within the original context.
- ``dynamic`` (NTK): the frequencies of a sequence no longer than ``max_position_embeddings``
  (i.e. unscaled), for every position. Equal to transformers within that length.
"""
from __future__ import annotations

import torch
from torch import nn


def rope_parameters_by_layer_type(config) -> dict[str | None, dict]:
    """{layer type or None: that layer type's rope parameters} (Gemma 3 has one per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:   # transformers 4 configs, or a hand-made one: rope_scaling + rope_theta
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_type", params.pop("type", "default"))
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if params and all(isinstance(v, dict) for v in params.values()):
        return dict(params)
    return {None: params}


def rope_theta_of(config) -> float:
    """The config's rotary base (the global layers' where they differ, as in Gemma 3)."""
    by_type = rope_parameters_by_layer_type(config)
    params = by_type.get("full_attention") or next(iter(by_type.values())) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _default_inv_freq(config, params: dict) -> torch.Tensor:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; ``lookup`` once per forward, ``apply_rotary`` per layer.

    ``inv_freq`` [rotary_dim / 2]; with ``long_inv_freq``, positions >= ``long_from`` use it.
    Tables are float32 [P, rotary_dim / 2], already multiplied by ``attention_scaling``.
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0,
                 long_inv_freq: torch.Tensor | None = None, long_from: int | None = None):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.float())                               # [P, rot/2]
        if long_inv_freq is not None and long_from is not None and long_from < max_positions:
            angles[long_from:] = torch.outer(positions[long_from:], long_inv_freq.float())
        self.rotary_dim = 2 * inv_freq.shape[0]
        self.register_buffer("cos", angles.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", angles.sin() * attention_scaling, persistent=False)

    @classmethod
    def plain(cls, head_dim: int, max_positions: int, theta: float) -> "RotaryEmbedding":
        """The unscaled rotary over the whole head (EAGLE heads)."""
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return cls(inv_freq, max_positions)

    @classmethod
    def from_config(cls, config, max_positions: int, layer_type: str | None = None) -> "RotaryEmbedding":
        """The table transformers' model builds for ``config`` (and Gemma 3's ``layer_type``)."""
        by_type = rope_parameters_by_layer_type(config)
        params = by_type[layer_type] if layer_type in by_type else next(iter(by_type.values()))
        params = params or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            return cls(_default_inv_freq(config, params), max_positions)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS[rope_type]
        kwargs = {"layer_type": layer_type} if layer_type else {}
        inv_freq, scaling = init(config, None, **kwargs)
        if rope_type != "longrope":
            return cls(inv_freq, max_positions, float(scaling))
        original = params["original_max_position_embeddings"]
        long_inv_freq, _ = init(config, None, seq_len=original + 1, **kwargs)
        return cls(inv_freq, max_positions, float(scaling), long_inv_freq, original)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rotary_dim] in the model dtype (as the reference casts them)."""
        cos = self.cos[positions].repeat(1, 2).unsqueeze(1).to(dtype)
        sin = self.sin[positions].repeat(1, 2).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd] rotated by position: x * cos + rotate_half(x) * sin over the first
    rotary_dim = cos.shape[-1] dims of each head; the rest pass through (partial rotary)."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((apply_rotary(x_rot, cos, sin), x_pass), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
