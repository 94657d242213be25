"""A weight matrix kept in the GGUF file's block formats (``QuantizedMatrix``).

The loader hands these to the layers instead of float tensors when the model runs
``dtype="auto"`` on a CPU (``loader.load_model(..., keep_quantized=True)``). A
layer fuses several of them (q, k, v; gate, up) by stacking rows, and tensor
parallelism cuts them by rows (column-parallel) or along whole blocks
(row-parallel). Rows of different formats may share one matrix: Q4_K_M files
store some v and down projections in Q6_K beside Q4_K q and k, so a matrix is a
list of *segments*, runs of rows in one format, each multiplied by its own
kernel call into its own columns of the output.

``packed_for_tiles()`` (at the end of loading, on CPUs with AMX): the segments whose format
the AMX kernels know are repacked into their tile order (``cpu_kernels/amx_tiles.h``) and from
then on multiplied on AMX tiles at every row count: float32 activations on bfloat16 tiles with
exact products (Q8_0's as three int8 pieces on int8 tiles), or, with ``int8_activations``, each
activation row as that many int8 pieces on int8 tiles (``amx_int8.h``; the segment's
``amx_int8``; Q6_K with 1-2 pieces keeps the VNNI kernel, ``quant_gemm.supports_amx_int8``);
cuts and stacks come before it.

``int8_activations`` (off by default): multiply with activations rounded to 8 bits
per 256 values and byte products (``cpu_kernels/q8_act.h``; ``q8_act_avx2.h`` on AVX2; on AMX
tiles per 32-value sub-block), llama.cpp's way, where the CPU and the format allow; the weights
stay the file's values. Cuts and
stacks keep the setting. An integer N (2-4) in place of True: each activation row as N
int8 pieces summed (``q8_act.h``): 3 pieces carry the row to about 2^-24 of each
256-value group's largest value, float32's precision; a 1-row step of the 1.5B took
about 0.6x the float32 kernels' time before the AMX kernel took a third of the tile
multiplies (docs/benchmarks.md, "Activation pieces", "AMX tiles: a third of the tile
multiplies").
On CPUs with AMX every setting runs on int8 tiles instead (``packed_for_tiles``), per 32-value
sub-block, where a verification of up to 16 / N rows costs about what one row costs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.huge_pages import cat_rows


# Formats a matrix can be requantized to (``QuantizedMatrix.requantize``): those ``gguf``'s Python
# quantizer writes and specserve's kernels multiply. Name -> ggml type id.
REQUANTIZE_FORMATS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8}


class BlockAlignmentError(ValueError):
    """A cut along the input dimension that does not fall on a block boundary."""


@dataclass
class QuantSegment:
    qtype: int            # ggml's type id (GGML_TYPE_Q4_K = 12, ...)
    data: torch.Tensor    # [rows, row_bytes] uint8: one row of blocks per output
    amx_packed: bool = False   # data is instead [rows / 16, amx row bytes] (quant_gemm.pack_for_amx)
    amx_int8: bool = False     # packed, and multiplied on int8 tiles (quant_gemm.AMX_INT8_FLAG)

    @property
    def rows(self) -> int:
        return self.data.shape[0] * (quant_gemm.AMX_GROUP if self.amx_packed else 1)


class QuantizedMatrix:
    """A [out, in] matrix as segments of rows in GGUF block formats (module docstring)."""

    def __init__(self, segments: list[QuantSegment], in_features: int, int8_activations: bool | int = False):
        self.segments = [s for s in segments if s.rows]
        self.in_features = in_features
        self.int8_activations = int8_activations

    def kernel_qtype(self, segment: QuantSegment) -> int:
        """The type id the kernels get for ``segment``: with the AMX-packing or int8-activation flag
        where it applies."""
        if segment.amx_packed and segment.amx_int8:
            return segment.qtype | quant_gemm.amx_int8_flags(self.int8_pieces)
        if segment.amx_packed:
            return segment.qtype | quant_gemm.AMX_PACKED_FLAG
        if self.int8_activations and quant_gemm.supports_int8_activations(segment.qtype, self.in_features):
            return segment.qtype | quant_gemm.int8_activation_flags(int(self.int8_activations))
        return segment.qtype

    @property
    def int8_pieces(self) -> int:
        """The int8 pieces an activation row becomes on int8 tiles: ``int8_activations``' count
        (True: 1), or for float32 activations (Q8_0 on the tiles) float32's FLOAT_PIECES."""
        return int(self.int8_activations) if self.int8_activations else quant_gemm.FLOAT_PIECES

    def _like(self, segments: list[QuantSegment], in_features: int | None = None) -> "QuantizedMatrix":
        return QuantizedMatrix(segments, self.in_features if in_features is None else in_features,
                               self.int8_activations)

    @classmethod
    def from_blocks(cls, data: torch.Tensor, qtype: int, in_features: int) -> "QuantizedMatrix":
        """data: [out, row_bytes] uint8 as stored in the file (a read-only view is fine)."""
        elems, nbytes = quant_gemm.block_geometry(qtype)
        if in_features % elems or data.shape[1] != in_features // elems * nbytes:
            raise ValueError(f"a ggml type {qtype} row of {in_features} values is not {data.shape[1]} bytes")
        return cls([QuantSegment(int(qtype), data)], in_features)

    # ----------------------------------------------------------------- shape and bytes
    @property
    def shape(self) -> tuple[int, int]:
        return (sum(s.rows for s in self.segments), self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    @property
    def qtypes(self) -> list[int]:
        return [s.qtype for s in self.segments]

    def to(self, *args, **kwargs) -> "QuantizedMatrix":
        """The blocks are the file's: no dtype or device conversion applies (CPU only)."""
        return self

    @property
    def amx_packed(self) -> bool:
        return any(s.amx_packed for s in self.segments)

    def packed_for_tiles(self, release: Callable[[list[torch.Tensor]], None] | None = None) -> "QuantizedMatrix":
        """This matrix with every segment an AMX kernel multiplies repacked for it: float32
        activations on bfloat16 tiles (``quant_gemm.supports_amx``; Q8_0 on int8 tiles as three int8
        pieces, ``float_activations_on_int8_tiles``), any ``int8_activations`` setting on int8 tiles
        in its piece count where ``supports_amx_int8`` takes it (not Q6_K with 1-2 pieces); itself
        when none is (no AMX, other formats).
        ``release`` gets the file's blocks as they are packed (``quant_gemm.pack_for_amx``)."""
        int8_tiles = bool(self.int8_activations)

        def supported(qtype: int, rows: int) -> bool:
            if int8_tiles:
                return quant_gemm.supports_amx_int8(qtype, rows, self.in_features, self.int8_pieces)
            return quant_gemm.supports_amx(qtype, rows, self.in_features)

        segments = [QuantSegment(s.qtype, quant_gemm.pack_for_amx(s.data, s.qtype, self.in_features, release), True,
                                 int8_tiles or quant_gemm.float_activations_on_int8_tiles(s.qtype))
                    if not s.amx_packed and supported(s.qtype, s.rows) else s
                    for s in self.segments]
        if all(a is b for a, b in zip(segments, self.segments)):
            return self
        return self._like(segments)

    def _check_unpacked(self, what: str) -> None:
        if self.amx_packed:
            raise ValueError(f"{what} a matrix packed for AMX tiles: cut and stack before packed_for_tiles()")

    # ----------------------------------------------------------------- cutting and joining
    def row_slice(self, start: int, length: int) -> "QuantizedMatrix":
        """Rows [start, start + length) (of a packed segment: on its 16-row groups only)."""
        out, first = [], 0
        for s in self.segments:
            n = s.rows
            lo, hi = max(start, first), min(start + length, first + n)
            if lo < hi and s.amx_packed:
                g = quant_gemm.AMX_GROUP
                if (lo - first) % g or (hi - first) % g:
                    raise ValueError(f"rows [{lo - first}, {hi - first}) of a segment packed for AMX tiles do "
                                     f"not fall on its {g}-row groups")
                out.append(QuantSegment(s.qtype, s.data[(lo - first) // g : (hi - first) // g], True, s.amx_int8))
            elif lo < hi:
                out.append(QuantSegment(s.qtype, s.data[lo - first : hi - first]))
            first += n
        return self._like(out)

    def col_slice(self, start: int, length: int) -> "QuantizedMatrix":
        """Input features [start, start + length); both must fall on block boundaries."""
        self._check_unpacked("cutting columns of")
        out = []
        for s in self.segments:
            elems, nbytes = quant_gemm.block_geometry(s.qtype)
            if start % elems or length % elems:
                raise BlockAlignmentError(
                    f"input features [{start}, {start + length}) do not fall on ggml type {s.qtype}'s "
                    f"{elems}-value blocks")
            b0, nb = start // elems, length // elems
            out.append(QuantSegment(s.qtype, s.data[:, b0 * nbytes : (b0 + nb) * nbytes].contiguous()))
        return self._like(out, length)

    def take_rows(self, index: torch.Tensor) -> "QuantizedMatrix":
        """Rows ``index`` (e.g. a draft vocabulary's rows of an LM head), one format only."""
        self._check_unpacked("taking rows of")
        if len(self.segments) != 1:
            raise ValueError("take_rows needs a matrix of one format")
        s = self.segments[0]
        return self._like([QuantSegment(s.qtype, s.data[index.to(torch.long)])])

    def pad_rows(self, rows: int) -> "QuantizedMatrix":
        """Append rows that are all zero: zero bytes dequantize to 0.0 in every format."""
        self._check_unpacked("padding")
        if rows <= 0:
            return self
        last = self.segments[-1]
        zeros = last.data.new_zeros(rows, last.data.shape[1])
        return self._like(self.segments + [QuantSegment(last.qtype, zeros)])

    @staticmethod
    def cat(mats: list["QuantizedMatrix"]) -> "QuantizedMatrix":
        """Stack rows (fusing q, k, v or gate, up); neighbouring segments of one format merge."""
        in_features = mats[0].in_features
        for m in mats:
            m._check_unpacked("stacking")
        if any(m.in_features != in_features for m in mats):
            raise ValueError("matrices to stack have different input widths")
        runs: list[list[QuantSegment]] = []   # neighbouring segments of one format
        for seg in (s for m in mats for s in m.segments):
            if runs and runs[-1][0].qtype == seg.qtype:
                runs[-1].append(seg)
            else:
                runs.append([seg])
        merged = []
        for run in runs:   # the kernel reads contiguous rows it owns
            data = run[0].data if len(run) == 1 else cat_rows([s.data for s in run])
            merged.append(QuantSegment(run[0].qtype, data.contiguous()))
        return QuantizedMatrix(merged, in_features, max(m.int8_activations for m in mats))

    def contiguous(self) -> "QuantizedMatrix":
        """Every segment in memory of its own (a copy out of a read-only file mapping, say)."""
        return self._like([QuantSegment(s.qtype, s.data.contiguous(), s.amx_packed, s.amx_int8) for s in self.segments])

    # ----------------------------------------------------------------- compute
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] float32 -> x @ W.T (+ bias) [..., out] float32."""
        leading = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape[0], self.shape[0], dtype=torch.float32)
        col = 0
        for s in self.segments:
            n = s.rows
            seg_bias = None if bias is None else bias[col : col + n]
            quant_gemm.quant_matmul_into(out, col, x2, s.data, self.kernel_qtype(s), self.in_features, seg_bias,
                                         amx_packed=s.amx_packed)
            col += n
        return out.view(*leading, out.shape[1])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] dequantized: [T, in] float32 (an embedding lookup)."""
        if len(self.segments) != 1:
            raise ValueError("an embedding table must be of one format")
        s = self.segments[0]
        return quant_gemm.dequantize_rows(s.data, s.qtype, self.in_features, ids.reshape(-1), s.amx_packed).view(
            *ids.shape, self.in_features)

    def requantize(self, qtype: int, rows_at_a_time: int = 4096) -> "QuantizedMatrix":
        """This matrix in another block format (a ``REQUANTIZE_FORMATS`` id): each segment's values
        (exactly the file's) quantized again by ``gguf``'s own quantizer, ``rows_at_a_time`` rows
        at a time (bounded memory for a 151,936-row LM head). Segments already in ``qtype`` are
        kept (a packed matrix comes back packed where the new format allows). Lossy: for a draft model, whose numbers only change its guesses (docs/real_models.md)."""
        from gguf import GGMLQuantizationType, quants

        if qtype not in REQUANTIZE_FORMATS.values():
            raise ValueError(f"cannot requantize to ggml type {qtype}; formats: {REQUANTIZE_FORMATS}")
        segments = []
        for s in self.segments:
            if s.qtype == qtype:
                segments.append(s)
                continue
            parts = []
            for start in range(0, s.rows, rows_at_a_time):
                ids = torch.arange(start, min(start + rows_at_a_time, s.rows))
                values = quant_gemm.dequantize_rows(s.data, s.qtype, self.in_features, ids,
                                                    s.amx_packed).numpy()   # [n, in] float32
                parts.append(torch.from_numpy(quants.quantize(values, GGMLQuantizationType(qtype))))
            segments.append(QuantSegment(int(qtype), torch.cat(parts).contiguous()))
        out = self._like(segments)
        return out.packed_for_tiles() if self.amx_packed else out

    def dequantize(self) -> torch.Tensor:
        """The whole matrix [out, in] float32, exactly the file's values."""
        parts = [quant_gemm.dequantize_rows(s.data, s.qtype, self.in_features, torch.arange(s.rows), s.amx_packed)
                 for s in self.segments]
        return torch.cat(parts) if parts else torch.empty(0, self.in_features)


def pack_for_tiles(model: torch.nn.Module,
                   release: Callable[[list[torch.Tensor]], None] | None = None) -> int:
    """Every matmul of ``model`` that holds GGUF blocks (layers with ``pack_for_tiles``: linear
    layers and the LM head, not the embedding lookup) repacked for AMX tiles where the CPU and
    the format allow; nothing changes elsewhere. ``release`` gets the former block tensors slice
    by slice as they are packed (``quant_gemm.pack_for_amx``; the loader drops their file pages).
    Returns how many matrices were repacked."""
    packed = 0
    for module in model.modules():
        if hasattr(module, "pack_for_tiles"):
            before = module.quantized
            module.pack_for_tiles(release)
            packed += module.quantized is not before
    return packed
