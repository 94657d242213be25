"""Tensor-parallel linear layers (Megatron style).

Column-parallel splits the output features across ranks (no communication);
row-parallel splits the input features and all-reduces the partial sums.
Each layer's ``load`` takes the FULL checkpoint tensor and keeps only its shard,
so a rank never holds more than its part after loading. A checkpoint tensor may
also be a ``QuantizedMatrix`` (GGUF blocks kept as they are, CPU only): the layer
then multiplies through the quantized kernel, and ``weight`` stays an empty
placeholder. A row-parallel cut that does not fall on the format's blocks is
dequantized instead (``BlockAlignmentError``), with a warning. LoRA adapters, where the model
enables them, add their low-rank products to the output (``lora.py``).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import SINGLE, TensorParallelGroup
from specserve.model_executor.layers.fp16_gemm import PackedFp16Weight
from specserve.model_executor.layers.lora import LoraWeights, fused_column_lora
from specserve.model_executor.layers.quantized import BlockAlignmentError, QuantizedMatrix

logger = logging.getLogger(__name__)


def _quantized_or_dense(parts: list) -> list:
    """Parts as given when all are QuantizedMatrix or all dense; a mix is made dense (float32)."""
    if all(isinstance(p, QuantizedMatrix) for p in parts) or not any(isinstance(p, QuantizedMatrix) for p in parts):
        return parts
    logger.warning("a fused layer mixes quantized and dense weights: its quantized parts are dequantized")
    return [p.dequantize() if isinstance(p, QuantizedMatrix) else p for p in parts]


class TilePackable:
    """``pack_for_tiles`` for a layer whose weight may be a ``QuantizedMatrix`` (``self.quantized``)."""

    quantized: QuantizedMatrix | None

    def pack_for_tiles(self, release: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Multiply on AMX tiles from now on where the CPU and the format allow (quantized.py);
        ``release`` gets the file's blocks as they are packed."""
        if self.quantized is not None:
            self.quantized = self.quantized.packed_for_tiles(release)


class ColumnParallelLinear(TilePackable, nn.Module):
    """y[..., out/N] = x @ W_shard.T ; the output stays sharded."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        tp: TensorParallelGroup = SINGLE,
        num_units: int | None = None,
    ):
        """``num_units``: each output is made of that many uncuttable units (heads by KV group)."""
        super().__init__()
        self.tp = tp
        self.num_units = num_units
        # Several logical outputs (q, k, v or gate, up) may be fused into one matmul;
        # each is sharded on its own so every rank gets its slice of each.
        self.shard_sizes = [tp.shard(size, "output features", num_units)[1] for size in out_sizes]
        out_local = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None
        self.packed: PackedFp16Weight | None = None  # set by pack_fp16 (CPU, dtype float16)
        self.quantized: QuantizedMatrix | None = None  # set by load from QuantizedMatrix parts
        self.lora: LoraWeights | None = None           # set where the model enables LoRA

    def set_lora(self, adapter_id: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None],
                 dtype: torch.dtype, device) -> None:
        """An adapter's full (A [r, in], B [out_i, r]) per fused output (None: that output not adapted)."""
        ab = fused_column_lora(parts, self._shard_rows, self.shard_sizes)
        if ab is not None:
            self.lora.adapters[adapter_id] = tuple(t.to(device=device, dtype=dtype) for t in ab)

    def pack_fp16(self) -> None:
        """Use the CPU fp16-weight matmul from now on (fp16_gemm); ``weight`` becomes its float16 tensor."""
        if self.quantized is not None:   # already in the file's own blocks
            return
        self.packed = PackedFp16Weight(self.weight, self.bias)
        self.weight.data = self.packed.weight   # the same float16 tensor

    def load(self, parts: list, bias_parts: list[torch.Tensor] | None = None) -> None:
        """parts: full [out_i, in] tensors (or QuantizedMatrix), one per fused output."""
        parts = _quantized_or_dense(parts)
        if isinstance(parts[0], QuantizedMatrix):
            self.quantized = QuantizedMatrix.cat([self._shard_rows(p) for p in parts])
            self.weight.data = torch.empty(0)
        else:
            self.weight.data = torch.cat([self._shard_rows(p) for p in parts])
        if self.bias is not None:
            assert bias_parts is not None, "this layer has a bias but none was loaded"
            self.bias.data = torch.cat([self._shard_rows(b) for b in bias_parts])

    def _shard_rows(self, full):
        start, length = self.tp.shard(full.shape[0], "output features", self.num_units)
        if isinstance(full, QuantizedMatrix):
            return full.row_slice(start, length)
        return full[start : start + length]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            y = self.quantized.matmul(x, self.bias)
        elif self.packed is not None:
            y = self.packed(x)
        else:
            y = F.linear(x, self.weight, self.bias)
        return self.lora.add_to(y, x) if self.lora is not None and self.lora.rows.active else y


class RowParallelLinear(TilePackable, nn.Module):
    """y = all_reduce(x[..., in/N] @ W_shard.T) (+ bias once, after the reduce)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallelGroup = SINGLE,
        num_units: int | None = None,
    ):
        """``num_units``: the input is made of that many uncuttable units (heads by KV group)."""
        super().__init__()
        self.tp = tp
        self.num_units = num_units
        _, in_local = tp.shard(in_features, "input features", num_units)
        self.weight = nn.Parameter(torch.empty(out_features, in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedFp16Weight | None = None  # set by pack_fp16 (CPU, dtype float16)
        self.quantized: QuantizedMatrix | None = None  # set by load from a QuantizedMatrix
        self.lora: LoraWeights | None = None           # set where the model enables LoRA

    def set_lora(self, adapter_id: int, ab: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype,
                 device) -> None:
        """An adapter's full (A [r, in], B [out, r]); this rank keeps its columns of A."""
        if ab is not None:
            start, length = self.tp.shard(ab[0].shape[1], "input features", self.num_units)
            self.lora.adapters[adapter_id] = (ab[0][:, start : start + length].to(device=device, dtype=dtype),
                                              ab[1].to(device=device, dtype=dtype))

    def pack_fp16(self) -> None:
        """Use the CPU fp16-weight matmul from now on (the bias is added after the all-reduce)."""
        if self.quantized is not None:   # already in the file's own blocks
            return
        self.packed = PackedFp16Weight(self.weight)
        self.weight.data = self.packed.weight   # the same float16 tensor

    def load(self, full, bias: torch.Tensor | None = None) -> None:
        start, length = self.tp.shard(full.shape[1], "input features", self.num_units)
        if isinstance(full, QuantizedMatrix):
            try:
                self.quantized = full.col_slice(start, length)
                self.weight.data = torch.empty(0)
            except BlockAlignmentError as exc:
                logger.warning("row-parallel shard not on whole blocks (%s): dequantized", exc)
                full = full.dequantize()
        if self.quantized is None:
            self.weight.data = full[:, start : start + length].contiguous()
        if self.bias is not None:
            self.bias.data = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            partial = self.quantized.matmul(x)
        else:
            partial = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
        if self.lora is not None and self.lora.rows.active:   # summed with the base's partial sums
            partial = self.lora.add_to(partial, x)
        y = self.tp.all_reduce(partial)
        return y + self.bias if self.bias is not None else y
