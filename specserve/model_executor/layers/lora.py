"""LoRA on the linear layers: the rows of a request with adapter a gain ``B_a (A_a x)``.

The adapters stay unmerged, so the base weights are untouched (GGUF blocks, float16 packs and
all) and one forward serves requests with different adapters and requests with none: each
adapter's rows are gathered, multiplied by its two small matrices and added back. The model
runner says which rows use which adapter before a forward (``LoraRows``); a step whose rows use
none adds nothing.

Tensor parallelism follows the base layer: a column-parallel layer keeps its rows of B (A whole);
a row-parallel layer keeps its columns of A (B whole), and its partial products are summed by the
same all-reduce as the base's, since ``sum_ranks B (A_rank x_rank) = B (A x)``.
"""
from __future__ import annotations

import torch


class LoraRows:
    """A step's rows by adapter, shared by every adapted layer of one model."""

    def __init__(self) -> None:
        # (adapter id, row indices [R] long on the model's device, or None for every row)
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.row_adapters: list[int] = []    # each row's adapter id (0: none), as set

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def set(self, row_adapters: list[int], device: torch.device) -> None:
        """``row_adapters``: each row's adapter id (0: none)."""
        self.row_adapters = list(row_adapters)
        ids = sorted(set(row_adapters) - {0})
        if len(ids) == 1 and all(a == ids[0] for a in row_adapters):
            self.groups = [(ids[0], None)]
            return
        self.groups = [(a, torch.tensor([i for i, r in enumerate(row_adapters) if r == a], dtype=torch.long)
                        .to(device, non_blocking=True)) for a in ids]

    def clear(self) -> None:
        self.groups = []
        self.row_adapters = []


class LoraWeights:
    """One linear layer's adapters, this rank's share: {adapter id: (A [r, in_local], B [out_local, r])}."""

    def __init__(self, rows: LoraRows) -> None:
        self.rows = rows
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kernel_pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        self._kernel_pairs.pop(adapter_id, None)

    def kernel_pair(self, adapter_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [r, in], B.T [r, out]) float32 contiguous, as the compiled CPU layers read them
        (``quant_layer``); None where the adapter leaves this layer alone."""
        if adapter_id not in self._kernel_pairs:
            ab = self.adapters.get(adapter_id)
            if ab is None:
                return None
            self._kernel_pairs[adapter_id] = (ab[0].float().contiguous(), ab[1].float().T.contiguous())
        return self._kernel_pairs[adapter_id]

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [T, out_local] += each adapted row's B (A x), x [T, in_local]; returns y (changed in place)."""
        for adapter_id, rows in self.rows.groups:
            ab = self.adapters.get(adapter_id)
            if ab is None:    # the adapter leaves this layer as it is
                continue
            a, b = ab
            if rows is None:
                y += (x.to(a.dtype) @ a.T) @ b.T
            else:
                y.index_add_(0, rows, ((x.index_select(0, rows).to(a.dtype) @ a.T) @ b.T).to(y.dtype))
        return y


def fused_column_lora(parts: list[tuple[torch.Tensor, torch.Tensor] | None], shard_rows,
                      shard_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One fused column-parallel layer's (A, B) from its parts' (q, k, v or gate, up; None = not adapted).

    A stacks the parts' A [r_i, in] -> [sum r_i, in]; B is block-diagonal [sum out_local_i, sum r_i],
    each part's rows of its B (``shard_rows``: this rank's rows of a full [out_i, r_i]) against its own
    rank's columns, zeros elsewhere, so one product gives every part its own adapter's output."""
    present = [(i, p) for i, p in enumerate(parts) if p is not None]
    if not present:
        return None
    a = torch.cat([p[0] for _, p in present])
    b = torch.zeros(sum(shard_sizes), a.shape[0], dtype=a.dtype)
    starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
    col = 0
    for i, (pa, pb) in present:
        local = shard_rows(pb)
        b[starts[i] : starts[i] + local.shape[0], col : col + pa.shape[0]] = local
        col += pa.shape[0]
    return a, b
