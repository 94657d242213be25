"""fp16-weight matrix multiplies for CPUs (fbgemm).

On a CPU a decode step is a handful of skinny matmuls (a few rows of
activations against large weight matrices). PyTorch's default fp32 GEMM runs
these compute-bound: on an AVX2 machine ``x @ W.T`` with W [3072, 576] takes
0.32 ms for one row and 0.72 ms for two, so verifying k draft tokens costs
almost k times one decode step and batching gains little. fbgemm's fp16-weight
GEMM keeps the weights in float16 (half the bytes to stream), converts them to
fp32 on the fly and accumulates in fp32: 0.13 ms for one row, 0.13 ms for two,
0.21 ms for five (docs/benchmarks.md, "Matmul kernels").

Activations, norms, attention and the logits stay float32; the weights are
rounded to float16 (11-bit mantissa, 8x finer than bfloat16), and so is the KV
cache where the attention kernel reads float16 (``attention.kv_cache_dtype_for``).
This is the CPU meaning of ``dtype="float16"``. On accelerators float16 is
the ordinary dtype and none of this is used.

Row invariance. fbgemm computes a call's rows in chunks of 1 to 6 rows, and its
1- and 2-row kernels sum in another order than the 3- to 6-row ones, so a row's
last bits depended on how many rows shared its call: a one-token decode step and
the same token verified with drafts differed by ~1e-6, and a near-tie could flip
a greedy token (1 of 52 Spec-Bench answers, 256 tokens each). Each call is
therefore padded with zero rows to the nearest row count whose chunks all have 3
rows or more (``exact_row_count``; a decode step at batch 1 runs 3 rows, which
made it ~20% slower here, docs/benchmarks.md), so every row gets the bits of the 3-6-row kernels
whatever the batch. Which counts qualify is measured once per process
(``_probe_exact_row_counts``), not assumed. ``SPECSERVE_EXACT_GEMM=0`` turns the
padding off: faster one-row steps, but greedy speculative output may then differ
from plain output at near-ties.
"""
from __future__ import annotations

import functools
import os

import torch

EXACT_GEMM = os.environ.get("SPECSERVE_EXACT_GEMM", "1") != "0"

# Row counts up to this are padded to an exact count; larger calls (long prefill
# chunks) run as they are: plain and speculative engines chunk a prompt alike.
EXACT_ROWS_LIMIT = 512


def cpu_fp16_gemm_available(device: torch.device | str) -> bool:
    """True on CPUs where PyTorch was built with fbgemm (x86-64 builds)."""
    return torch.device(device).type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines


def compute_dtype_for(weight_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype of activations and the KV cache for weights stored in ``weight_dtype``.

    CPUs compute float16-weight models in float32 (see the module docstring);
    everywhere else activations share the weights' dtype.
    """
    if weight_dtype == torch.float16 and torch.device(device).type == "cpu":
        return torch.float32
    return weight_dtype


def round_to_weight_dtype(
    model: torch.nn.Module, weight_dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device | str
) -> None:
    """After loading in ``compute_dtype``: switch the matmuls to ``weight_dtype`` storage.

    Uses fbgemm's packed fp16 GEMM where available; elsewhere the weights keep
    float32 storage but hold float16-rounded values, so the model's numbers
    are the same on every CPU.
    """
    if weight_dtype == compute_dtype:
        return
    use_fbgemm = cpu_fp16_gemm_available(device)
    for module in model.modules():
        if not hasattr(module, "pack_fp16"):  # layers with a matmul weight define pack_fp16
            continue
        if use_fbgemm:
            module.pack_fp16()
        else:
            module.weight.data = module.weight.data.to(weight_dtype).to(compute_dtype)


@functools.lru_cache(maxsize=None)
def _probe_exact_row_counts(limit: int = EXACT_ROWS_LIMIT) -> tuple[bool, ...]:
    """exact[m]: an m-row call gives every row the bits of that row in a 3-row call.

    Measured on a small random weight: fbgemm's split of m rows into kernels does not
    depend on the weight's shape or the thread count (checked against the default
    model's shapes at 1 and 2 threads).
    """
    gen = torch.Generator().manual_seed(0)
    in_features = 256
    packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(32, in_features, generator=gen), None)
    x = torch.randn(limit, in_features, generator=gen)           # [limit, in]
    gemm = torch.ops.quantized.linear_dynamic_fp16.default
    pad = x.new_zeros(2, in_features)
    reference = torch.cat([gemm(torch.cat([x[j : j + 1], pad]), packed)[:1] for j in range(limit)])  # [limit, 32]
    return (False,) + tuple(torch.equal(gemm(x[:m], packed), reference[:m]) for m in range(1, limit + 1))


def exact_row_count(rows: int) -> int:
    """The row count to run a ``rows``-row call at so that each row's bits do not depend on ``rows``."""
    if rows > EXACT_ROWS_LIMIT or not EXACT_GEMM:
        return rows
    exact = _probe_exact_row_counts()
    return next((m for m in range(rows, EXACT_ROWS_LIMIT + 1) if exact[m]), rows)


def skip_row_padding(model: torch.nn.Module) -> None:
    """A draft's matmuls need not be row-invariant (its tokens are only proposals, checked by
    the target): run them unpadded, which keeps its one-row steps cheaper."""
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, PackedFp16Weight):
            packed.exact_rows = False


class PackedFp16Weight:
    """A weight [out, in] (and optional bias [out]) prepacked for fbgemm's fp16 GEMM."""

    exact_rows = True   # pad calls to row-invariant row counts (module docstring)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self._packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float().contiguous(), None if bias is None else bias.detach().float()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] fp32 -> [T, out] fp32
        rows = x.shape[0]
        padded = exact_row_count(rows) if self.exact_rows else rows
        if padded != rows:   # zero rows up to an exact count (module docstring)
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])   # [padded, in]
        # The overload itself: the packet's Python-side dispatch checks cost ~10 us a call.
        out = torch.ops.quantized.linear_dynamic_fp16.default(x, self._packed)   # [padded, out]
        return out if padded == rows else out[:rows]

