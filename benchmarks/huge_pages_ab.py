"""Weights in transparent huge pages against 4 KiB pages: plain decode speed, one process.

specserve puts the weight buffers it builds at load (the AMX packing of GGUF blocks, merged
and copied matrices) in memory advised huge (``layers/huge_pages.py``);
``SPECSERVE_HUGE_PAGES=off`` keeps ``torch.empty``'s 4 KiB pages. This script loads the model
once each way in one process and alternates greedy decode rounds between the two engines
(who goes first alternates too), so both see the same machine. Prints decode tok/s (median
and rounds) and each engine's huge-page bytes.

    python benchmarks/huge_pages_ab.py --model qwen2.5-coder-1.5b-instruct --rounds 7

``--matrices``: the 1.5B's LM head (Q6_K) and gate/up (Q4_K) shapes alone, random blocks packed
as the engine packs them, cycling through copies (~300 MB) so the weights come from memory; ms a
call at 1 and 5 rows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llamacpp_peer import specserve_decode  # noqa: E402  (the shared decode timer)


def anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def matrices(rounds: int) -> None:
    import torch

    sys.path.insert(0, str(HERE.parent / "tests" / "model_executor" / "layers"))
    from test_quant_gemm import random_blocks

    from specserve.model_executor.layers.quantized import QuantizedMatrix

    print("| matrix | rows | 4 KiB pages ms | huge pages ms | huge / 4 KiB time |\n|---|---|---|---|---|")
    for name, qtype, out_f, in_f in (("LM head Q6_K", 14, 151936, 1536), ("gate/up Q4_K", 12, 17920, 1536)):
        one = torch.from_numpy(random_blocks(qtype, out_f, in_f, seed=1))
        copies = max(1, (300 << 20) // one.numel())
        mats = {}
        for label, setting in (("4 KiB", "off"), ("huge", "")):
            os.environ["SPECSERVE_HUGE_PAGES"] = setting
            mats[label] = [QuantizedMatrix.from_blocks(one.clone(), qtype, in_f).packed_for_tiles()
                           for _ in range(copies)]
        os.environ.pop("SPECSERVE_HUGE_PAGES")
        for rows in (1, 5):
            x = torch.randn(rows, in_f)
            ms: dict[str, list[float]] = {label: [] for label in mats}
            for _ in range(rounds):
                for label, group in mats.items():
                    start = time.perf_counter()
                    for m in group:
                        m.matmul(x)
                    ms[label].append((time.perf_counter() - start) / len(group) * 1e3)
            a, b = statistics.median(ms["4 KiB"]), statistics.median(ms["huge"])
            print(f"| {name} [{out_f}, {in_f}] | {rows} | {a:.2f} | {b:.2f} | {b / a:.3f} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="catalog name or .gguf path (default: the default model)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--matrices", action="store_true", help="single matrices instead of a model's decoding")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.matrices:
        matrices(max(args.rounds, 9))
        return 0

    from specserve import LLM

    engines, huge = {}, {}
    for label, setting in (("4 KiB pages", "off"), ("huge pages", "")):
        os.environ["SPECSERVE_HUGE_PAGES"] = setting
        before = anon_huge_kib()
        engines[label] = LLM(model=args.model, dtype="auto", max_model_len=1024, kv_cache_memory=1 << 27)
        huge[label] = anon_huge_kib() - before
        specserve_decode(engines[label], 8)   # warm-up
    os.environ.pop("SPECSERVE_HUGE_PAGES")
    rates: dict[str, list[float]] = {label: [] for label in engines}
    labels = list(engines)
    for r in range(args.rounds):
        for label in labels[r % 2:] + labels[: r % 2]:
            rates[label].append(specserve_decode(engines[label], args.tokens))
    base = statistics.median(rates[labels[0]])
    print(f"| model | pages | huge-page MiB | decode tok/s (rounds) | ratio |\n|---|---|---|---|---|")
    for label in labels:
        m = statistics.median(rates[label])
        print(f"| {args.model or 'default'} | {label} | {huge[label] / 1024:.0f} | {m:.2f} "
              f"({', '.join(f'{x:.1f}' for x in rates[label])}) | {m / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
