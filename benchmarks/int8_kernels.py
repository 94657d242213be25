"""int8 against float32 activations, side by side in one run (docs/benchmarks.md, "int8 activations").

``--kernels``: one thread, a 512 x 1536 matrix of random blocks (in cache), 1, 4 and 5 rows,
G weight-rows/s, the two settings alternating 2 rounds each (best of each).
``--model NAME``: a model's forward (one decode step's rows: 1, 2, 4, 5 at context 64), ms,
best of 4 per round, 2 rounds.

    python benchmarks/int8_kernels.py --kernels
    python benchmarks/int8_kernels.py --model qwen2.5-coder-1.5b-instruct
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def kernels() -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "model_executor", "layers"))
    from gguf import GGMLQuantizationType as T
    from test_quant_gemm import random_blocks

    from specserve.model_executor.layers.quantized import QuantizedMatrix

    torch.set_num_threads(1)
    out_f, in_f = 512, 1536
    print("| format, rows | float32 activations | int8 activations |\n|---|---|---|")
    for qt in (T.Q4_K, T.Q6_K, T.Q8_0):
        m = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(qt, out_f, in_f, seed=1)), int(qt), in_f)
        for rows in (1, 4, 5):
            x = torch.randn(rows, in_f)
            best = {False: 0.0, True: 0.0}
            for flag in (False, True, False, True):
                m.int8_activations = flag
                for _ in range(3):
                    m.matmul(x)
                start, n = time.perf_counter(), 200
                for _ in range(n):
                    m.matmul(x)
                best[flag] = max(best[flag], out_f * in_f * rows * n / (time.perf_counter() - start) / 1e9)
            print(f"| {qt.name}, {rows} | {best[False]:.1f} | {best[True]:.1f} |", flush=True)


def forward_by_rows(model: str) -> None:
    from specserve import LLM
    from specserve.worker.model_runner import ForwardInput

    torch.set_num_threads(2)
    llms = {f: LLM(model=model, max_model_len=1024, kv_cache_memory=1 << 27, int8_activations=f) for f in (False, True)}
    best: dict = {}
    for _ in range(2):
        for flag, llm in llms.items():
            for rows in (1, 2, 4, 5):
                inp = [ForwardInput(list(range(100, 100 + rows)), 64, list(range(5)), rows)]
                llm.engine.runner.execute(inp)
                for _ in range(4):
                    start = time.perf_counter()
                    llm.engine.runner.execute(inp)
                    ms = (time.perf_counter() - start) * 1000
                    best[flag, rows] = min(best.get((flag, rows), ms), ms)
    print("| activations | 1 row | 2 rows | 4 rows | 5 rows |\n|---|---|---|---|---|")
    for flag in (False, True):
        print(f"| {'int8' if flag else 'float32'} | " + " | ".join(f"{best[flag, r]:.1f}" for r in (1, 2, 4, 5)) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--model", default=None, help="a catalog name or path: forward time by row count")
    args = p.parse_args()
    if args.kernels:
        kernels()
    if args.model:
        forward_by_rows(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
