"""Paged attention on a CPU: the compiled kernel against the PyTorch path, side by side.

Both paths run the same steps in one process, alternated call by call, on the
default model's attention shapes (9 query heads, 3 KV heads, head_dim 64,
16-token blocks), float32. A step is B requests with q new tokens each:
decoding (q = 1), verification of 5 drafts (q = 6) and a prefill (q = 100,
which both paths hand to SDPA). Contexts are 60-260 tokens (decode and
verify). Reports the median and minimum microseconds per layer call.

    python benchmarks/attention_kernels.py --threads 2
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from specserve.model_executor.layers import cpu_attention
from specserve.model_executor.layers.attention import AttentionMetadata, kv_cache_shape, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def make_step(batch: int, q_len: int, rng: random.Random, kernel: bool):
    contexts = [rng.randint(60, 260) if q_len < 40 else q_len for _ in range(batch)]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(batch)]
    usable = cpu_attention.usable
    if not kernel:
        cpu_attention.usable = lambda *args: False
    try:
        meta = AttentionMetadata.build([q_len] * batch, contexts, tables, BLOCK, torch.device("cpu"))
    finally:
        cpu_attention.usable = usable
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.usable("cpu", torch.float32):
        raise SystemExit("the CPU attention kernel did not build here; nothing to compare")
    kv_cache = torch.randn(kv_cache_shape(400, BLOCK, KV_HEADS, HEAD_DIM))
    print(f"torch threads {args.threads}; median / min microseconds per layer call")
    print("| batch | new tokens per request | PyTorch path (SDPA) | compiled kernel | speedup |")
    print("|---|---|---|---|---|")
    for batch, q_len in [(1, 1), (1, 6), (16, 1), (16, 6), (16, 100)]:
        metas = {kernel: make_step(batch, q_len, random.Random(0), kernel) for kernel in (False, True)}
        tokens = batch * q_len
        q = torch.randn(tokens, HEADS, HEAD_DIM)
        k, v = torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)
        times: dict[bool, list[float]] = {False: [], True: []}
        repeats = max(5, args.repeats // (1 if batch == 1 else 4 if q_len < 40 else 20))
        with torch.inference_mode():
            for _ in range(repeats):
                for kernel in (False, True):
                    start = time.perf_counter()
                    paged_attention(q, k, v, kv_cache, metas[kernel], HEAD_DIM**-0.5)
                    times[kernel].append((time.perf_counter() - start) * 1e6)
        torch_med, kernel_med = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {batch} | {q_len} | {torch_med:.0f} / {min(times[False]):.0f} | "
              f"{kernel_med:.0f} / {min(times[True]):.0f} | {torch_med / kernel_med:.2f}x |")


if __name__ == "__main__":
    main()
