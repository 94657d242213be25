"""Paged attention on a CPU: the compiled kernel against the PyTorch path, side by side.

The variants run the same steps in one process, alternated call by call, on the
default model's attention shapes (9 query heads, 3 KV heads, head_dim 64,
16-token blocks), float32 queries:

- the PyTorch path (gather + SDPA) over a float32 cache;
- the kernel over a float32 cache on one thread;
- the kernel over a float32 cache on torch's threads (``--threads``);
- the kernel over a float16 cache on torch's threads (what ``dtype="auto"`` runs).

A step is B requests with q new tokens each: decoding (q = 1), verification of
5 drafts (q = 6) and prefill chunks (q = 100).
Contexts are 60-260 tokens (decode and verify). Each call uses the next of
``--layers`` caches, as a forward does, and each variant has its own, so K/V
are read from memory rather than from the CPU's caches. Reports the median and minimum microseconds
per layer call.

Then, for whole prompts with nothing cached (one request, T tokens), SDPA with
the additive causal mask against SDPA's own causal mode (what specserve runs for
such a group since it skips the masked blocks), alternated call by call.

Last, with a float16 cache, the kernel writing the step's new K/V itself against
torch writing them first (``index_copy_``) and the kernel attending.

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


def make_step(batch: int, q_len: int, rng: random.Random, kernel: bool, cache_dtype: torch.dtype):
    contexts = [rng.randint(60, 260) if q_len < 40 else q_len for _ in range(batch)]
    per_req = -(-max(contexts) // BLOCK)  # blocks per request
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(batch)]
    usable = cpu_attention.usable
    if not kernel:
        cpu_attention.usable = lambda *args: False
    try:
        meta = AttentionMetadata.build([q_len] * batch, contexts, tables, BLOCK, torch.device("cpu"),
                                       cache_dtype=cache_dtype)
    finally:
        cpu_attention.usable = usable
    return meta


VARIANTS = ["PyTorch path", "kernel, 1 thread", "kernel", "kernel, float16 cache"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--layers", type=int, default=30, help="caches cycled through, one per call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.usable("cpu", torch.float32):
        raise SystemExit("the CPU attention kernel did not build here; nothing to compare")
    variants = VARIANTS if cpu_attention.reads_float16_cache() else VARIANTS[:-1]
    # Each variant its own caches: one variant must not find another's K/V in the CPU's caches.
    shape = kv_cache_shape(400, BLOCK, KV_HEADS, HEAD_DIM)
    dtype_of = {v: torch.float16 if "float16" in v else torch.float32 for v in variants}
    caches = {v: [torch.randn(shape).to(dtype_of[v]) for _ in range(args.layers)] for v in variants}
    print(f"torch threads {args.threads}; median / min microseconds per layer call")
    print("| batch | new tokens per request | " + " | ".join(variants) + " | PyTorch path / last |")
    print("|---|---|" + "---|" * len(variants) + "---|")
    for batch, q_len in [(1, 1), (1, 6), (16, 1), (16, 6), (16, 100)]:
        metas = {v: make_step(batch, q_len, random.Random(0), kernel=v != "PyTorch path",
                              cache_dtype=caches[v][0].dtype) for v in variants}
        tokens = batch * q_len
        q = torch.randn(tokens, HEADS, HEAD_DIM)
        k, v_new = torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)
        times: dict[str, list[float]] = {v: [] for v in variants}
        repeats = max(5, args.repeats // (1 if batch == 1 else 4 if q_len < 40 else 20))
        with torch.inference_mode():
            for i in range(repeats):
                for v in variants:
                    cache = caches[v][i % args.layers]
                    torch.set_num_threads(1 if v == "kernel, 1 thread" else args.threads)
                    start = time.perf_counter()
                    paged_attention(q, k, v_new, cache, metas[v], HEAD_DIM**-0.5)
                    times[v].append((time.perf_counter() - start) * 1e6)
        torch.set_num_threads(args.threads)
        medians = {v: statistics.median(t) for v, t in times.items()}
        cells = " | ".join(f"{medians[v]:.0f} / {min(times[v]):.0f}" for v in variants)
        print(f"| {batch} | {q_len} | {cells} | {medians[variants[0]] / medians[variants[-1]]:.2f}x |")

    fresh_prompts(args)
    kv_writes(args)


def kv_writes(args) -> None:
    """The whole attention call with a float16 cache: the kernel writing the new K/V
    itself (what specserve runs when it serves the whole step) against torch writing them
    first (two index_copy_ of converted, transposed views) and the kernel attending."""
    if not cpu_attention.reads_float16_cache():
        return
    print("\n| batch | new tokens per request | kernel writes K/V | torch writes K/V, then kernel | torch / kernel |")
    print("|---|---|---|---|---|")
    shape = kv_cache_shape(400, BLOCK, KV_HEADS, HEAD_DIM)
    modes = ("kernel writes", "torch writes")
    caches = {m: [torch.randn(shape).half() for _ in range(args.layers)] for m in modes}
    for batch, q_len in [(1, 1), (1, 6), (16, 1)]:
        meta = make_step(batch, q_len, random.Random(0), kernel=True, cache_dtype=torch.float16)
        kn = meta.kernel
        tokens = batch * q_len
        q = torch.randn(tokens, HEADS, HEAD_DIM)
        k, v_new = torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)
        times: dict[str, list[float]] = {m: [] for m in modes}
        with torch.inference_mode():
            for i in range(args.repeats if batch == 1 else args.repeats // 4):
                for m in modes:
                    cache = caches[m][i % args.layers]
                    start = time.perf_counter()
                    if m == "kernel writes":
                        paged_attention(q, k, v_new, cache, meta, HEAD_DIM**-0.5)
                    else:
                        slots = cache.view(2, KV_HEADS, -1, HEAD_DIM)
                        slots[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(cache.dtype))
                        slots[1].index_copy_(1, meta.slot_mapping, v_new.transpose(0, 1).to(cache.dtype))
                        cpu_attention.paged_attention_cpu(q, cache, q.new_empty(q.shape), kn.block_tables,
                                                          kn.query_start, kn.query_lens, kn.context_lens,
                                                          HEAD_DIM**-0.5)
                    times[m].append((time.perf_counter() - start) * 1e6)
        med = {m: statistics.median(t) for m, t in times.items()}
        print(f"| {batch} | {q_len} | {med[modes[0]]:.0f} / {min(times[modes[0]]):.0f} | "
              f"{med[modes[1]]:.0f} / {min(times[modes[1]]):.0f} | {med[modes[1]] / med[modes[0]]:.2f}x |")


def fresh_prompts(args) -> None:
    """Masked SDPA against causal-mode SDPA for one fresh prompt of T tokens."""
    print("\n| prompt tokens | masked SDPA | causal SDPA | masked / causal |")
    print("|---|---|---|---|")
    for length in (100, 400, 780):
        blocks = -(-length // BLOCK)
        metas = {}
        for mode in ("masked", "causal"):
            metas[mode] = make_step(1, length, random.Random(0), kernel=False, cache_dtype=torch.float32)
            metas[mode].groups[0].fresh = mode == "causal"
        cache = torch.randn(kv_cache_shape(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM))
        q = torch.randn(length, HEADS, HEAD_DIM)
        k, v_new = torch.randn(length, KV_HEADS, HEAD_DIM), torch.randn(length, KV_HEADS, HEAD_DIM)
        times: dict[str, list[float]] = {"masked": [], "causal": []}
        with torch.inference_mode():
            for _ in range(max(5, args.repeats // 20)):
                for mode, meta in metas.items():
                    start = time.perf_counter()
                    paged_attention(q, k, v_new, cache, meta, HEAD_DIM**-0.5)
                    times[mode].append((time.perf_counter() - start) * 1e6)
        med = {m: statistics.median(t) for m, t in times.items()}
        print(f"| {length} | {med['masked']:.0f} / {min(times['masked']):.0f} | "
              f"{med['causal']:.0f} / {min(times['causal']):.0f} | {med['masked'] / med['causal']:.2f}x |")


if __name__ == "__main__":
    main()
