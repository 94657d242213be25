"""fp16-weight matrix multiplies for CPUs.

On a CPU a decode step is a handful of skinny matmuls (a few rows of
activations against large weight matrices), bound by streaming the weights from
memory. PyTorch's default fp32 GEMM runs these compute-bound: on an AVX2 machine
``x @ W.T`` with W [3072, 576] takes 0.32 ms for one row and 0.72 ms for two, so
verifying k draft tokens costs almost k times one decode step and batching gains
little. Keeping the weights in float16 halves the bytes to stream; they are
converted to fp32 on the fly and accumulated in fp32 (docs/benchmarks.md,
"Matmul kernels").

Activations, norms, attention and the logits stay float32; the weights are
rounded to float16 (11-bit mantissa, 8x finer than bfloat16), and so is the KV
cache where the attention kernel reads float16 (``attention.kv_cache_dtype_for``).
This is the CPU meaning of ``dtype="float16"``. On accelerators float16 is
the ordinary dtype and none of this is used.

Two implementations, the same values up to float32 rounding:

- ``cpu_gemm``: specserve's own kernel (the default where it builds). Every
  output element is summed in one fixed order, so a row's bits never depend on
  how many rows share its call; and it prefetches the weights, which makes a
  decode step's matmuls faster than fbgemm's.
- fbgemm's fp16-weight GEMM (``torch.ops.quantized``), the fallback. fbgemm runs
  a call's rows in chunks through 1-, 2- and 3-6-row kernels that sum in
  different orders, so a row's last bits depended on how many rows shared its
  call: a one-token decode step and the same token verified with drafts differed
  by ~1e-6, and a near-tie could flip a greedy token (1 of 52 Spec-Bench answers,
  256 tokens each). On this path each call is therefore padded with zero rows to
  the nearest row count whose chunks all have 3 rows or more (``exact_row_count``;
  a decode step at batch 1 then runs 3 rows, ~20% slower), so every row gets the
  bits of the 3-6-row kernels whatever the batch. Which counts qualify is measured
  once per process (``_probe_exact_row_counts``), not assumed.
  ``SPECSERVE_EXACT_GEMM=0`` turns the padding off: faster one-row steps, but
  greedy speculative output may then differ from plain output at near-ties.
"""
from __future__ import annotations

import functools
import os

import torch

from specserve.model_executor.layers import cpu_gemm

def exact_gemm() -> bool:
    """``SPECSERVE_EXACT_GEMM`` (default on), read at each call, so a setting made after
    import (a test, an embedding application) is honoured."""
    return os.environ.get("SPECSERVE_EXACT_GEMM", "1") != "0"


# Row counts up to this are padded to an exact count; larger calls (long prefill
# chunks) run as they are: plain and speculative engines chunk a prompt alike.
EXACT_ROWS_LIMIT = 512


def fbgemm_available() -> bool:
    """True where PyTorch was built with fbgemm (x86-64 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def cpu_fp16_gemm_available(device: torch.device | str) -> bool:
    """True on CPUs with an fp16-weight matmul: specserve's kernel or fbgemm."""
    return torch.device(device).type == "cpu" and (fbgemm_available() or cpu_gemm.available())


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

    Uses an fp16-weight matmul where one is available; elsewhere the weights keep
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
    if rows > EXACT_ROWS_LIMIT or not exact_gemm():
        return rows
    exact = _probe_exact_row_counts()
    return next((m for m in range(rows, EXACT_ROWS_LIMIT + 1) if exact[m]), rows)


def skip_row_padding(model: torch.nn.Module) -> None:
    """A draft's matmuls need not be row-invariant (its tokens are only proposals, checked by
    the target): on the fbgemm path run them unpadded, which keeps its one-row steps cheaper."""
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, PackedFp16Weight):
            packed.exact_rows = False


class PackedFp16Weight:
    """A weight [out, in] (and optional bias [out]) in float16 for the CPU matmuls (module docstring)."""

    exact_rows = True   # on the fbgemm path, pad calls to row-invariant row counts

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach().half().contiguous()                          # [out, in] float16
        self.bias = None if bias is None else bias.detach().float().contiguous()   # [out] float32
        self._packed = None   # fbgemm's own copy, only where specserve's kernel does not serve
        if not cpu_gemm.serves(self.weight.shape[1]):
            self._packed = torch.ops.quantized.linear_prepack_fp16(self.weight.float(), self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] fp32 -> [T, out] fp32
        if self._packed is None:
            return cpu_gemm.fp16_weight_matmul(x, self.weight, self.bias)
        rows = x.shape[0]
        padded = exact_row_count(rows) if self.exact_rows else rows
        if padded != rows:   # zero rows up to an exact count (module docstring)
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])   # [padded, in]
        # The overload itself: the packet's Python-side dispatch checks cost ~10 us a call.
        out = torch.ops.quantized.linear_dynamic_fp16.default(x, self._packed)   # [padded, out]
        return out if padded == rows else out[:rows]
