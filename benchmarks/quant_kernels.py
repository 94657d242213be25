"""The GGUF block-format matmul kernel, format by format, against the float16 kernel on the same values.

A [--out, --in] weight of random blocks (scales of a real weight's size) is
multiplied by 1 and 6 rows (``--rows``), best of ``--repeat`` x 10 calls, on
``--threads`` threads; the float16 kernel multiplies the same dequantized values,
interleaved call batch by call batch. The weight is small enough to stay in L2,
so this measures arithmetic, not memory: in a real forward the float16 kernel
streams 2 bytes a weight against the blocks' 0.56-1.06.

    python benchmarks/quant_kernels.py --threads 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model_executor", "layers"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=int, default=1024)
    p.add_argument("--in", dest="in_features", type=int, default=512)
    p.add_argument("--rows", default="1,6")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--formats", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from gguf import GGMLQuantizationType
    from test_quant_gemm import random_blocks   # random blocks with finite float16 scales

    from specserve.model_executor.layers import cpu_gemm
    from specserve.model_executor.layers.quantized import QuantizedMatrix

    rows = [int(r) for r in args.rows.split(",")]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} weight [{args.out}, {args.in_features}], threads={args.threads}")
    print("| format | " + " | ".join(f"blocks, {r} row(s), Gweights/s | float16, {r}" for r in rows) + " |")
    print("|---|" + "---|---|" * len(rows))
    for name in args.formats.split(","):
        qtype = GGMLQuantizationType[name]
        m = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(qtype, args.out, args.in_features)),
                                        int(qtype), args.in_features)
        half = m.dequantize().half()
        cells = []
        for r in rows:
            x = torch.randn(r, args.in_features)
            best_q = best_h = float("inf")
            for _ in range(args.repeat):
                t = time.perf_counter()
                for _ in range(10):
                    m.matmul(x)
                best_q = min(best_q, (time.perf_counter() - t) / 10)
                t = time.perf_counter()
                for _ in range(10):
                    cpu_gemm.fp16_weight_matmul(x, half, None)
                best_h = min(best_h, (time.perf_counter() - t) / 10)
            weights = args.out * args.in_features
            cells.append(f"{weights / best_q / 1e9:.1f} | {weights / best_h / 1e9:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
