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
"""
from __future__ import annotations

import torch


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


class PackedFp16Weight:
    """A weight [out, in] (and optional bias [out]) prepacked for fbgemm's fp16 GEMM."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self._packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float().contiguous(), None if bias is None else bias.detach().float()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] fp32 -> [T, out] fp32
        # The overload itself: the packet's Python-side dispatch checks cost ~10 us a call.
        return torch.ops.quantized.linear_dynamic_fp16.default(x, self._packed)

