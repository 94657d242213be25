"""specserve's row-invariant fp16-weight matmul for CPUs (``cpu_kernels/fp16_gemm.c``).

``out = x @ w.T (+ bias)`` for float32 activations x [rows, in] and float16
weights w [out, in], accumulated in float32. Every output element is summed in
one fixed order whatever the number of rows in the call and the thread count, so
a token's logits have the same bits whether it is decoded alone, verified with
drafts or batched with other requests: the property greedy speculative decoding
needs to equal plain decoding token for token (fp16_gemm's docstring says why
fbgemm lacks it). It is also faster than fbgemm for the few-row calls of decoding
and verification: 1.6-2x per forward's matmuls at 1-6 rows on the development
machine (docs/benchmarks.md, "Matmul kernels").

Compiled on first use (``kernel_build.LazyLibrary``). Unavailable (the Python
side then uses fbgemm) without a C compiler, on CPUs without F16C, when the
build fails, or with ``SPECSERVE_CPU_GEMM=fbgemm``.
"""
from __future__ import annotations

import ctypes

import torch

from specserve.model_executor.layers.kernel_build import LazyLibrary

# -ffp-contract=off: the compiler fuses no multiply-add on its own; the kernel's sums are
# exactly as written, so every output element is the same sequence of operations.
COMPILE_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off"]


def _setup(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specserve_fp16_gemm.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
    lib.specserve_fp16_gemm.restype = ctypes.c_int
    lib.specserve_fp16_gemm_vector_width.restype = ctypes.c_int
    if lib.specserve_fp16_gemm_vector_width() == 0:
        raise RuntimeError("this CPU has no F16C (float16 conversion instructions)")


LIBRARY = LazyLibrary("fp16_gemm.c", COMPILE_FLAGS, _setup, "SPECSERVE_CPU_GEMM", "fbgemm", "fbgemm")
_load = LIBRARY.get


def available() -> bool:
    """True when the kernel is built (compiler, F16C, not turned off)."""
    return _load() is not None


def serves(in_features: int) -> bool:
    """True when the kernel is built and handles this input width (a multiple of its vector width)."""
    lib = _load()
    return lib is not None and in_features % lib.specserve_fp16_gemm_vector_width() == 0


def fp16_weight_matmul(
    x: torch.Tensor,            # [..., in] float32 on the CPU; rows may be strided
    weight: torch.Tensor,       # [out, in] float16, contiguous
    bias: torch.Tensor | None,  # [out] float32, contiguous
) -> torch.Tensor:              # [..., out] float32
    lib = _load()
    assert lib is not None, "call serves() first"
    assert x.dtype == torch.float32 and weight.dtype == torch.float16 and weight.is_contiguous()
    leading = x.shape[:-1]
    if x.dim() != 2 or x.stride(1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    rows, (out_features, in_features) = x.shape[0], weight.shape
    assert x.shape[1] == in_features and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return out.view(*leading, out_features)
    status = lib.specserve_fp16_gemm(x.data_ptr(), x.stride(0), rows, weight.data_ptr(), out_features, in_features,
                                     None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                     torch.get_num_threads())
    if status == -3:
        raise MemoryError("fp16 matmul kernel: scratch allocation failed")
    if status:
        raise RuntimeError(f"fp16 matmul kernel failed ({status}) for weight {tuple(weight.shape)}")
    return out.view(*leading, out_features)
