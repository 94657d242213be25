"""Is a matrix's call bound by its work or by its bytes? The same matmul hot in cache and streamed.

For each matrix (random GGUF blocks of a format and shape, packed as the engine packs them:
AMX tiles where the CPU has them), one row at a time: "hot" multiplies one copy again and
again (it stays in L2/L3 when it fits there), "streamed" cycles through ``--copies`` copies
so every call reads its weights from memory. Alternated round by round; medians. When the
two times are close the call is bound by its work; when "streamed" is slower, by its bytes,
and the GB/s printed is the rate they arrived at.

    python benchmarks/hot_or_streamed.py
    python benchmarks/hot_or_streamed.py --matrices Q6_K:1536x8960,Q4_K:17920x1536 --rounds 9
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model_executor" / "layers"))
from test_quant_gemm import random_blocks  # noqa: E402  (the tests' random GGUF blocks)

from specserve.model_executor.layers.quantized import QuantizedMatrix  # noqa: E402

# Qwen2.5-Coder-1.5B: the Q6_K down projection, the Q4_K gate/up, an eighth of the Q6_K LM head
DEFAULT = "Q6_K:1536x8960,Q4_K:17920x1536,Q6_K:18992x1536"


def timed(mats, x, reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        for m in mats:
            m.matmul(x)
    return (time.perf_counter() - started) / (reps * len(mats))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--matrices", default=DEFAULT, help="comma-separated FORMAT:OUTxIN")
    p.add_argument("--copies", type=int, default=16, help="copies cycled for the streamed figure")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("| matrix | MB | hot ms | streamed ms | streamed / hot | streamed GB/s |\n|---|---|---|---|---|---|")
    for spec in args.matrices.split(","):
        name, shape = spec.split(":")
        out_f, in_f = (int(v) for v in shape.split("x"))
        qtype = int(GGMLQuantizationType[name])
        blocks = torch.from_numpy(random_blocks(qtype, out_f, in_f, seed=0))
        mats = [QuantizedMatrix.from_blocks(blocks.clone(), qtype, in_f).packed_for_tiles() for _ in range(args.copies)]
        x = torch.randn(1, in_f)
        timed(mats, x, 1)   # warm: code, scratch, every copy touched once
        hot, streamed = [], []
        for _ in range(args.rounds):
            hot.append(timed(mats[:1], x, 2 * args.copies))
            streamed.append(timed(mats, x, 2))
        nbytes = sum(s.data.numel() * s.data.element_size() for s in mats[0].segments)
        h, s = statistics.median(hot), statistics.median(streamed)
        print(f"| {name} [{out_f}, {in_f}] | {nbytes / 1e6:.1f} | {h * 1e3:.3f} | {s * 1e3:.3f} | {s / h:.2f}x | "
              f"{nbytes / s / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
