"""specserve's matmul over GGUF block-format weights for CPUs (``cpu_kernels/quant_gemm.c``).

``out = x @ dequantize(w).T (+ bias)`` for float32 activations x [rows, in] and a
weight held as the GGUF file's blocks ([out, row_bytes] uint8, one row of blocks per
output). The blocks are unpacked inside the kernel, four output rows at a time, to
exactly the values ggml's dequantization gives, then multiplied by the same
row-invariant float32 core as the float16 kernel (``cpu_gemm``): a row's result
never depends on how many rows share the call or on the thread count.

Why: a batch-1 decode step streams every weight once, and GGUF's formats hold
4.5-8.5 bits per weight where float16 holds 16 (docs/benchmarks.md, "Quantized
weights"). Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; others are
dequantized to float16 at load (``supports``).

Compiled on first use (``kernel_build.LazyLibrary``). Unavailable without a C
compiler, on CPUs without F16C, or with ``SPECSERVE_CPU_QUANT=off``; the loader
then dequantizes every tensor to float16 at load, as before.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable

import torch

from specserve.model_executor.layers.huge_pages import empty_in_huge_pages
from specserve.model_executor.layers.kernel_build import LazyLibrary

COMPILE_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off"]


def _setup(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.specserve_quant_gemm.argtypes = [ptr, i64, i64, ptr, c_int, i64, i64, ptr, ptr, i64, c_int]
    lib.specserve_quant_gemm.restype = c_int
    lib.specserve_quant_dequantize.argtypes = [ptr, c_int, ptr, i64, i64, ptr, c_int]
    lib.specserve_quant_dequantize.restype = c_int
    for name in ("specserve_quant_block_elems", "specserve_quant_block_bytes", "specserve_quant_amx_float_on_int8"):
        getattr(lib, name).argtypes = [c_int]
        getattr(lib, name).restype = c_int
    lib.specserve_quant_int8_supported.argtypes = [c_int, i64]
    lib.specserve_quant_int8_supported.restype = c_int
    lib.specserve_quant_vector_width.restype = c_int
    lib.specserve_quant_amx_supported.argtypes = [c_int, i64, i64]
    lib.specserve_quant_amx_supported.restype = c_int
    lib.specserve_quant_amx_int8_built.argtypes = []
    lib.specserve_quant_amx_int8_built.restype = c_int
    lib.specserve_quant_amx_row_bytes.argtypes = [c_int, i64]
    lib.specserve_quant_amx_row_bytes.restype = i64
    lib.specserve_quant_amx_pack.argtypes = [ptr, c_int, i64, i64, ptr, c_int]
    lib.specserve_quant_amx_pack.restype = c_int
    if lib.specserve_quant_vector_width() == 0:
        raise RuntimeError("this CPU has no F16C (float16 conversion instructions)")


LIBRARY = LazyLibrary("quant_gemm.c", COMPILE_FLAGS, _setup, "SPECSERVE_CPU_QUANT", "off",
                      "float16 weights dequantized at load")
_load = LIBRARY.get


def available() -> bool:
    """True when the kernel is built (compiler, F16C, not turned off)."""
    return _load() is not None


def supports(qtype: int) -> bool:
    """True when the kernel is built and multiplies weights of this ggml type id."""
    lib = _load()
    return lib is not None and lib.specserve_quant_block_elems(int(qtype)) > 0


# Set on a qtype passed to the kernels: int8 activations (``cpu_kernels/q8_act.h``).
INT8_ACTIVATIONS_FLAG = 256
# With INT8_ACTIVATIONS_FLAG: (pieces - 1) << INT8_PIECES_SHIFT multiplies each activation row
# as that many int8 pieces (``cpu_kernels/q8_act.h``, Q8_PIECES_SHIFT).
INT8_PIECES_SHIFT = 10
MAX_INT8_PIECES = 4


def _piece_bits(pieces: int) -> int:
    """The piece count's bits in a type id, shared by the VNNI kernel's and the AMX int8 tiles' flags."""
    if not 1 <= pieces <= MAX_INT8_PIECES:
        raise ValueError(f"int8 activation pieces must be 1 to {MAX_INT8_PIECES}, got {pieces}")
    return (pieces - 1) << INT8_PIECES_SHIFT


def int8_activation_flags(pieces: int) -> int:
    """The qtype flags for int8 activations in ``pieces`` pieces (1: rounded to 8 bits per 256
    values; 3: the float32 row to about 2^-24 of each group's largest value)."""
    return INT8_ACTIVATIONS_FLAG | _piece_bits(pieces)


@functools.cache   # asked on every matmul of a matrix with the setting on; the answer never changes
def supports_int8_activations(qtype: int, in_features: int) -> bool:
    """True when this CPU (AVX-512 VNNI or AVX2) and build multiply this format (Q4_1, Q5_0, Q8_0, Q4_K,
    Q6_K) with int8 activations."""
    lib = _load()
    return lib is not None and bool(lib.specserve_quant_int8_supported(int(qtype), int(in_features)))


# Set on a qtype passed to the kernels: the weight bytes are packed for AMX tiles
# (``cpu_kernels/amx_tiles.h``), [out / 16, amx_row_bytes] uint8.
AMX_PACKED_FLAG = 512
AMX_GROUP = 16   # output rows per packed row
# With AMX_PACKED_FLAG: multiply on int8 tiles (``cpu_kernels/amx_int8.h``) instead of bfloat16
# tiles, each activation row as (pieces - 1) << INT8_PIECES_SHIFT int8 pieces: ``int8_activations``
# on CPUs with AMX, and float32 activations of the formats ``float_activations_on_int8_tiles`` names.
AMX_INT8_FLAG = 4096
FLOAT_PIECES = 3   # int8 pieces that carry a float32 row (about 2^-24 of each sub-block's largest value)


def amx_int8_flags(pieces: int) -> int:
    """The qtype flags of a matrix packed for AMX tiles and multiplied on int8 tiles with each
    activation row as ``pieces`` int8 pieces (a pass of the tiles takes 16 // pieces rows)."""
    return AMX_PACKED_FLAG | AMX_INT8_FLAG | _piece_bits(pieces)


def supports_amx(qtype: int, out_features: int, in_features: int) -> bool:
    """True when this CPU (AMX tiles, granted by the OS) and build multiply a [out, in] matrix of this
    format on AMX tiles with float32 activations, and ``SPECSERVE_CPU_AMX`` is not ``off``."""
    lib = _load()
    return (lib is not None and os.environ.get("SPECSERVE_CPU_AMX", "").lower() != "off"
            and bool(lib.specserve_quant_amx_supported(int(qtype), int(out_features), int(in_features))))


def amx_tiles_available() -> bool:
    """True when this CPU, OS and build multiply GGUF blocks on AMX tiles with float32 activations
    (a Q4_K matrix of one 16-row group is asked)."""
    from gguf import GGMLQuantizationType

    return supports_amx(int(GGMLQuantizationType.Q4_K), AMX_GROUP, 256)


def amx_int8_tiles_available() -> bool:
    """True when this CPU, OS and build also multiply GGUF blocks on AMX int8 tiles with int8
    activations (a Q4_K matrix of one 16-row group, one piece, is asked)."""
    from gguf import GGMLQuantizationType

    return supports_amx_int8(int(GGMLQuantizationType.Q4_K), AMX_GROUP, 256, 1)


def float_activations_on_int8_tiles(qtype: int) -> bool:
    """True for the formats whose float32 activations the AMX kernels multiply on int8 tiles, as
    FLOAT_PIECES int8 pieces (float32's precision), rather than on bfloat16 tiles: Q8_0, whose
    8-bit codes int8 tiles take as they are (``amx_tiles.h``'s ``amx_bf16_takes`` says why)."""
    lib = _load()
    return lib is not None and bool(lib.specserve_quant_amx_float_on_int8(int(qtype)))


# Q6_K's packing holds a byte a code (8.75 bits a weight against the file's 6.56), so its 1-row step
# streams a third more bytes than the VNNI kernel (q8_act.h) reads: with 1 or 2 pieces that kernel
# wins the decode step (1536 x 8960 at 1 row: 0.34 against 0.45 ms, 1 piece), the tiles only from
# 5-9 rows on. With 3 or more pieces the tiles lose less at 1 row (0.57 against 0.49 ms) and win
# from 5 rows on (1.55 against 2.35). Both kernels timed alternately in one process on the AMX Xeon
# VM of docs/architecture.md's figures ("int8_activations (and Q8_0) on int8 tiles").
Q6_K_INT8_TILES_FROM_PIECES = 3


def supports_amx_int8(qtype: int, out_features: int, in_features: int, pieces: int = FLOAT_PIECES) -> bool:
    """True when such a packed matrix is multiplied on AMX int8 tiles (``AMX_INT8_FLAG``) with each
    activation row as ``pieces`` int8 pieces: this build has them, and the format takes that count
    there (Q6_K from Q6_K_INT8_TILES_FROM_PIECES on; fewer keep the VNNI kernel)."""
    from gguf import GGMLQuantizationType

    if int(qtype) == GGMLQuantizationType.Q6_K and pieces < Q6_K_INT8_TILES_FROM_PIECES:
        return False
    return supports_amx(qtype, out_features, in_features) and bool(_load().specserve_quant_amx_int8_built())


# Rows packed per call of pack_for_amx's kernel: its ``release`` gets each such slice once done.
AMX_PACK_ROWS = 4096


def pack_for_amx(data: torch.Tensor, qtype: int, in_features: int,
                 release: Callable[[list[torch.Tensor]], None] | None = None) -> torch.Tensor:
    """data [out, row_bytes] uint8 (the file's blocks) -> [out / 16, amx row bytes] uint8: the same
    values in the AMX kernel's tile order (``amx_tiles.h``). ``supports_amx`` must hold.
    ``release`` gets each slice of ``data`` (AMX_PACK_ROWS rows) as soon as it is packed, so a
    big matrix (an LM head) never holds all its file pages beside its whole packing."""
    lib = _load()
    assert lib is not None and supports_amx(qtype, data.shape[0], in_features)
    data = data.contiguous()
    packed = empty_in_huge_pages((data.shape[0] // AMX_GROUP, lib.specserve_quant_amx_row_bytes(int(qtype), in_features)))
    for r0 in range(0, data.shape[0], AMX_PACK_ROWS):
        rows = data[r0 : r0 + AMX_PACK_ROWS]
        check_status(lib.specserve_quant_amx_pack(rows.data_ptr(), int(qtype), rows.shape[0], in_features,
                                                  packed[r0 // AMX_GROUP :].data_ptr(), torch.get_num_threads()),
                     f"packing ggml type {qtype} for AMX")
        if release is not None:
            release([rows])
    return packed


def block_geometry(qtype: int) -> tuple[int, int]:
    """(values, bytes) per block of a supported ggml type id."""
    lib = _load()
    assert lib is not None and supports(qtype), f"ggml type {qtype} is not supported"
    return lib.specserve_quant_block_elems(int(qtype)), lib.specserve_quant_block_bytes(int(qtype))


def check_status(status: int, what: str) -> None:
    """Raise for a quantized kernel's nonzero return (-3: scratch allocation failed)."""
    if status == -3:
        raise MemoryError(f"quantized kernel: scratch allocation failed ({what})")
    if status:
        raise RuntimeError(f"quantized kernel failed ({status}) for {what}")


def quant_matmul_into(
    out: torch.Tensor,          # [rows, out_total] float32; columns [col, col + n) are written
    col: int,
    x: torch.Tensor,            # [rows, in] float32, last dimension contiguous
    data: torch.Tensor,         # [n, row_bytes] uint8, contiguous: the GGUF blocks of n output rows
    qtype: int,
    in_features: int,
    bias: torch.Tensor | None,  # [n] float32, contiguous
    int8_activations: bool = False,
    amx_packed: bool = False,
) -> None:
    """``qtype`` may already carry the kernel flags (``QuantizedMatrix.kernel_qtype``: int8
    activations with their piece count, AMX packing). ``int8_activations``: quantize x to 8 bits
    per 256 values and multiply bytes (llama.cpp's way, faster); ignored where
    ``supports_int8_activations`` is False. ``amx_packed``: data is
    ``pack_for_amx``'s [n / 16, amx row bytes]."""
    lib = _load()
    assert lib is not None, "call supports() first"
    assert x.dtype == torch.float32 and x.stride(-1) == 1 and x.shape[1] == in_features
    assert data.dtype == torch.uint8 and data.is_contiguous() and out.stride(1) == 1
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    rows = x.shape[0]
    n = data.shape[0] * (AMX_GROUP if amx_packed else 1)
    assert bias is None or bias.shape[0] == n
    if rows == 0 or n == 0:
        return
    flags = (INT8_ACTIVATIONS_FLAG if int8_activations else 0) | (AMX_PACKED_FLAG if amx_packed else 0)
    status = lib.specserve_quant_gemm(
        x.data_ptr(), x.stride(0), rows, data.data_ptr(), int(qtype) | flags,
        n, in_features,
        None if bias is None else bias.data_ptr(), out.data_ptr() + col * out.element_size(), out.stride(0),
        torch.get_num_threads())
    check_status(status, f"ggml type {qtype}, weight [{n}, {in_features}]")


def dequantize_rows(
    data: torch.Tensor,         # [n_rows, row_bytes] uint8, contiguous
    qtype: int,
    in_features: int,
    ids: torch.Tensor,          # [T] int64 row indices
    amx_packed: bool = False,   # data is pack_for_amx's [n_rows / 16, amx row bytes]
) -> torch.Tensor:              # [T, in] float32
    lib = _load()
    assert lib is not None, "call supports() first"
    ids = ids.to(torch.int64).contiguous()
    n_rows = data.shape[0] * (AMX_GROUP if amx_packed else 1)
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < n_rows):
        raise IndexError(f"row ids out of range [0, {n_rows})")
    qtype = int(qtype) | (AMX_PACKED_FLAG if amx_packed else 0)
    out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
    if ids.shape[0]:
        status = lib.specserve_quant_dequantize(data.data_ptr(), int(qtype), ids.data_ptr(), ids.shape[0],
                                                in_features, out.data_ptr(), torch.get_num_threads())
        check_status(status, f"dequantizing ggml type {qtype}")
    return out
