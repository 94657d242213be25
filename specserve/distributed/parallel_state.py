"""The tensor-parallel group a model runs in, passed explicitly (no module globals).

A target at TP N and a draft at TP 1 can live in one process because each
model holds its own ``TensorParallelGroup``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: object | None = None   # a torch.distributed ProcessGroup when world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's shard along the last dimension."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's slice of a dimension of ``size``."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size {self.world_size}")
        length = size // self.world_size
        return self.rank * length, length


SINGLE = TensorParallelGroup()
