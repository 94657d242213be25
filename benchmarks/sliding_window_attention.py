"""The CPU attention kernel with a sliding window against the same call without one.

A row at position p sees only keys p - W + 1 .. p under a window of W keys, and the
kernel (``cpu_kernels/paged_attention.c``) never reads the keys before a row's
window, so at long contexts a windowed layer (Mistral's, Gemma's local layers)
should cost about W / context of a global one. This times both on the same step,
alternated call by call, each call on the next of ``--layers`` caches (K/V come from
memory, as in a forward), through ``paged_attention`` (the kernel also writes the
step's new K/V). Shapes: the default model (9 query heads, 3 KV heads, head_dim 64)
and Gemma 3 1B (4, 1, 256; its local layers' window is 512); 16-token blocks,
float16 and float32 caches. Reports the median microseconds per layer call.

    python benchmarks/sliding_window_attention.py --threads 2 --context 4096 --window 512
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.model_executor.layers import cpu_attention
from specserve.model_executor.layers.attention import AttentionMetadata, kv_cache_shape, paged_attention

BLOCK = 16
SHAPES = [("SmolLM2", 9, 3, 64), ("Gemma 3 1B", 4, 1, 256)]   # (label, query heads, KV heads, head_dim)


def time_case(heads: int, kv_heads: int, hd: int, batch: int, q_len: int, context: int, window: int,
              cache_dtype: torch.dtype, repeats: int, layers: int) -> dict[str, float]:
    per_req = -(-context // BLOCK)
    caches = [torch.randn(kv_cache_shape(batch * per_req, BLOCK, kv_heads, hd)).to(cache_dtype)
              for _ in range(layers)]
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(batch)]
    meta = AttentionMetadata.build([q_len] * batch, [context] * batch, tables, BLOCK, torch.device("cpu"),
                                   cache_dtype=cache_dtype)
    assert meta.kernel is not None
    q = torch.randn(batch * q_len, heads, hd)
    k, v = torch.randn(batch * q_len, kv_heads, hd), torch.randn(batch * q_len, kv_heads, hd)
    times: dict[str, list[float]] = {"no window": [], f"window {window}": []}
    for _ in range(repeats):
        for name, w in (("no window", None), (f"window {window}", window)):
            start = time.perf_counter()
            for cache in caches:
                paged_attention(q, k, v, cache, meta, hd ** -0.5, sliding_window=w)
            times[name].append((time.perf_counter() - start) / layers * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", type=int, default=4096, help="tokens in the cache, new ones included")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--layers", type=int, default=8, help="caches cycled through, one per call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.usable("cpu", torch.float32):
        raise SystemExit("the CPU attention kernel did not build here")
    dtypes = [torch.float16, torch.float32] if cpu_attention.reads_float16_cache() else [torch.float32]
    print(f"torch threads {args.threads}; context {args.context}; median microseconds per layer call")
    print(f"| model shape | cache | batch | new tokens | no window | window {args.window} | speed-up |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for label, heads, kv_heads, hd in SHAPES:
            for cache_dtype in dtypes:
                for batch, q_len in ((1, 1), (1, 6)):   # a decode step, a verification of 5 drafts
                    t = time_case(heads, kv_heads, hd, batch, q_len, args.context, args.window, cache_dtype,
                                  args.repeats, args.layers)
                    full, windowed = t["no window"], t[f"window {args.window}"]
                    print(f"| {label} | {str(cache_dtype).removeprefix('torch.')} | {batch} | {q_len} | {full:.0f} "
                          f"| {windowed:.0f} | {full / windowed:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
