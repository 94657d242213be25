from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / rms(x) * w``, or with ``offset`` 1 (Gemma) ``* (1 + w)``.

    Gemma's reference normalizes in float32 and multiplies by ``1 + w`` in float32 before
    casting back, so an offset norm keeps its effective weight ``offset + w`` in float32
    and computes in float32 (the same numbers in float32, the reference's order in
    bfloat16). ``weight`` always holds the checkpoint's ``w``.
    """

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.register_buffer("effective_weight", None, persistent=False)   # [hidden] float32, offset norms only

    def load(self, weight: torch.Tensor) -> None:
        self.weight.data = weight
        if self.offset:
            self.effective_weight = weight.float() + self.offset

    def kernel_weight(self) -> torch.Tensor:
        """[hidden] float32: what x / rms(x) is multiplied by (the compiled CPU kernels' input)."""
        return (self.effective_weight if self.offset else self.weight.data).float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return F.rms_norm(x.float(), self.weight.shape, self.effective_weight, self.eps).to(x.dtype)
        # One fused kernel (it accumulates in fp32 for half-precision inputs).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
