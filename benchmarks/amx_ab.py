"""The AMX-tile path of the GGUF-block matmul against the AVX-512 path, one checkout, one process.

On a CPU with AMX, specserve repacks the matrices whose format the tile kernel knows (Q4_K,
Q4_1, Q6_K) at load and multiplies them on AMX tiles with float32 activations
(``cpu_kernels/amx_tiles.h``); ``SPECSERVE_CPU_AMX=off`` keeps the AVX-512 kernel. This
script times both, alternated round by round:

``--matrices``: the matmul alone on random blocks of a model's shapes (``--shapes``), cycling
through enough copies that the weights stream from memory; G weight-rows/s (median).

``--model NAME``: a model's forward over one step's rows (1 = a decode step, k + 1 = a
verification, at context 64) with each path; ms (median).

    python benchmarks/amx_ab.py --matrices --model qwen2.5-coder-1.5b-instruct
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from forward_timing import print_table, time_forwards, with_amx  # noqa: E402  (the shared timing loop)
from quant_kernel_ab import SHAPES  # noqa: E402  (the model shapes, one definition)

from specserve.model_executor.layers import quant_gemm  # noqa: E402

PATHS = ("AVX-512", "AMX")


def matrices(shapes, rows_list, rounds: int) -> None:
    sys.path.insert(0, str(HERE.parent / "tests" / "model_executor" / "layers"))
    from test_quant_gemm import random_blocks

    from specserve.model_executor.layers.quantized import QuantizedMatrix

    print("| matrix | rows | AVX-512 G weight-rows/s | AMX | AMX / AVX-512 |\n|---|---|---|---|---|")
    for name, qt, out_f, in_f in shapes:
        one = torch.from_numpy(random_blocks(qt, out_f, in_f, seed=1))
        copies = max(1, (256 << 20) // one.numel())   # one pass streams ~256 MB: weights come from memory
        plain = [QuantizedMatrix.from_blocks(one.clone(), qt, in_f) for _ in range(copies)]
        packed = [m.packed_for_tiles() for m in plain]
        if not packed[0].amx_packed:
            print(f"| {name} [{out_f}, {in_f}] | - | AMX does not take ggml type {qt} here | | |")
            continue
        for rows in rows_list:
            x = torch.randn(rows, in_f)
            groups = dict(zip(PATHS, (plain, packed)))
            for group in groups.values():
                for m in group:
                    m.matmul(x)
            rates: dict[str, list[float]] = {p: [] for p in PATHS}
            for _ in range(rounds):
                for p, group in groups.items():
                    start = time.perf_counter()
                    for m in group:
                        m.matmul(x)
                    rates[p].append(out_f * in_f * rows * copies / (time.perf_counter() - start) / 1e9)
            med = {p: statistics.median(r) for p, r in rates.items()}
            print(f"| {name} [{out_f}, {in_f}] | {rows} | {med['AVX-512']:.1f} | {med['AMX']:.1f} | "
                  f"{med['AMX'] / med['AVX-512']:.2f}x |", flush=True)


def model_forward(model: str, rows_list, rounds: int) -> None:
    from specserve import LLM

    llms = {p: with_amx(p == "AMX", lambda: LLM(model=model, max_model_len=1024, kv_cache_memory=1 << 27))
            for p in PATHS}
    print_table(time_forwards(llms, rows_list, rounds), list(PATHS), rows_list, ratio=("AVX-512", "AMX"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--matrices", action="store_true")
    p.add_argument("--model", default=None, help="a catalog name or path: forward time by row count")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="qwen2.5-coder-1.5b")
    p.add_argument("--rows", default="1,2,4,5,8,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not with_amx(True, lambda: quant_gemm.supports_amx(12, 16, 256)):
        print("this CPU, OS or build has no AMX path: nothing to compare")
        return 1
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"float32 activations, {args.threads} threads, {args.rounds} rounds alternated")
    if args.matrices:
        matrices(SHAPES[args.shapes], rows_list, args.rounds)
    if args.model:
        model_forward(args.model, rows_list, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
