"""Skinny matmuls on this CPU: why specserve stores weights in float16 here.

A decode step multiplies a few rows of activations (1 per request, k+1 when
verifying drafts) by every weight matrix. This times ``F.linear`` in float32 and
bfloat16 against fbgemm's fp16-weight GEMM (what specserve uses on CPUs for
``dtype="float16"``/``"auto"``) for the default model's weight shapes, at the
row counts a step has, in one run:

    python benchmarks/matmul_kernels.py --threads 1
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specserve.model_executor.layers.fp16_gemm import PackedFp16Weight, cpu_fp16_gemm_available

# SmolLM2-135M: fused q/k/v, o, fused gate/up, down, LM head ([out, in]).
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def time_ms(fn, min_seconds: float = 0.3) -> float:
    for _ in range(3):
        fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,2,5,16")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_fp16_gemm_available("cpu"):
        raise SystemExit("this PyTorch build has no fbgemm (not x86-64?)")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    print("| weight [out, in] | rows | fp32 ms | bf16 ms | fp16-weight (fbgemm) ms | fp32 / fp16-weight |")
    print("|---|---|---|---|---|---|")
    totals = {m: [0.0, 0.0, 0.0] for m in rows}
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f)
        w_bf16 = w.bfloat16()
        packed = PackedFp16Weight(w)
        for m in rows:
            x = torch.randn(m, in_f)
            x_bf16 = x.bfloat16()
            t32 = time_ms(lambda: F.linear(x, w))
            tbf = time_ms(lambda: F.linear(x_bf16, w_bf16))
            t16 = time_ms(lambda: packed(x))
            for i, t in enumerate((t32, tbf, t16)):
                totals[m][i] += t * (30 if name != "lm_head" else 1)
            print(f"| {name} {list((out_f, in_f))} | {m} | {t32:.3f} | {tbf:.3f} | {t16:.3f} | {t32 / t16:.1f}x |")
    print()
    print("Whole model (30 layers + LM head), ms of matmul per forward:\n")
    print("| rows | fp32 | bf16 | fp16-weight | cost vs 1 row (fp16-weight) |")
    print("|---|---|---|---|---|")
    for m in rows:
        t32, tbf, t16 = totals[m]
        print(f"| {m} | {t32:.1f} | {tbf:.1f} | {t16:.1f} | {t16 / totals[rows[0]][2]:.2f}x |")


if __name__ == "__main__":
    main()
