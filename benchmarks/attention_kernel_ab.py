"""The CPU attention kernel of this checkout against the one of another git revision.

Builds ``cpu_kernels/paged_attention.c`` as it was at ``--baseline`` (same flags,
same compiler) next to this checkout's, and times both in one process, call by
call alternated, over decode, verification and prefill shapes of the default
model (9 query heads, 3 KV heads, head_dim 64) and of Qwen2.5-Coder-1.5B (12, 2,
128), float16 cache (what ``dtype="auto"`` runs on a CPU), 16-token blocks.
Each call cycles through ``--layers`` caches so K/V come from memory. The
baseline must have the same C entry point (``specserve_paged_attention``).
Reports the median microseconds per layer call.

    python benchmarks/attention_kernel_ab.py --baseline 422f7ff --threads 2
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specserve.model_executor.layers import cpu_attention
from specserve.model_executor.layers.attention import AttentionMetadata, kv_cache_shape, paged_attention
from specserve.model_executor.layers.kernel_build import KERNEL_DIR

BLOCK = 16
# (label, query heads, KV heads, head_dim, batch, new tokens per request, context)
CASES = [
    ("SmolLM2", 9, 3, 64, 1, 1, 200), ("SmolLM2", 9, 3, 64, 1, 1, 1000), ("SmolLM2", 9, 3, 64, 1, 4, 1000),
    ("SmolLM2", 9, 3, 64, 1, 1, 4000), ("SmolLM2", 9, 3, 64, 16, 1, 200), ("SmolLM2", 9, 3, 64, 16, 6, 200),
    ("SmolLM2", 9, 3, 64, 64, 1, 150), ("SmolLM2", 9, 3, 64, 1, 100, 100), ("SmolLM2", 9, 3, 64, 1, 512, 512),
    ("Qwen 1.5B", 12, 2, 128, 1, 1, 300), ("Qwen 1.5B", 12, 2, 128, 1, 4, 1000), ("Qwen 1.5B", 12, 2, 128, 8, 4, 300),
]


def build_baseline(revision: str, workdir: Path) -> ctypes.CDLL:
    """The kernel source at ``revision``, compiled with this checkout's flags."""
    repo = KERNEL_DIR.parents[3]
    rel = KERNEL_DIR.relative_to(repo) / "paged_attention.c"
    source = workdir / "paged_attention_baseline.c"
    source.write_text(subprocess.run(["git", "-C", str(repo), "show", f"{revision}:{rel}"], check=True,
                                     capture_output=True, text=True).stdout)
    compiler = shutil.which("cc") or shutil.which("gcc")
    target = workdir / "paged_attention_baseline.so"
    subprocess.run([compiler, *cpu_attention.COMPILE_FLAGS, "-shared", "-fPIC", str(source), "-o", str(target),
                    "-fopenmp", "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    cpu_attention._setup(lib)
    return lib


def time_case(libs: dict, case: tuple, repeats: int, layers: int) -> dict[str, float]:
    _, heads, kv_heads, hd, batch, q_len, ctx = case
    per_req = -(-ctx // BLOCK)
    caches = [torch.randn(kv_cache_shape(batch * per_req + 1, BLOCK, kv_heads, hd)).half() for _ in range(layers)]
    tables = [list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i in range(batch)]
    meta = AttentionMetadata.build([q_len] * batch, [ctx] * batch, tables, BLOCK, torch.device("cpu"),
                                   cache_dtype=torch.float16)
    q = torch.randn(batch * q_len, heads, hd)
    k, v = torch.randn(batch * q_len, kv_heads, hd), torch.randn(batch * q_len, kv_heads, hd)
    times: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(repeats):
        for name, lib in libs.items():
            cpu_attention._load = lambda lib=lib: lib   # what usable() and paged_attention_cpu call
            start = time.perf_counter()
            for cache in caches:
                paged_attention(q, k, v, cache, meta, hd ** -0.5)
            times[name].append((time.perf_counter() - start) / layers * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision whose kernel is the baseline")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layers", type=int, default=8, help="caches cycled through, one per call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    current = cpu_attention.LIBRARY.get()
    if current is None or not cpu_attention.reads_float16_cache():
        raise SystemExit("the CPU attention kernel did not build here (or reads no float16 cache)")
    real_load = cpu_attention._load
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"baseline": build_baseline(args.baseline, Path(tmp)), "this checkout": current}
        print(f"torch threads {args.threads}; median microseconds per layer call, float16 cache")
        print("| model shape | batch | new tokens | context | baseline | this checkout | baseline / this |")
        print("|---|---|---|---|---|---|---|")
        try:
            with torch.inference_mode():
                for case in CASES:
                    t = time_case(libs, case, args.repeats, args.layers)
                    label, _, _, _, batch, q_len, ctx = case
                    print(f"| {label} | {batch} | {q_len} | {ctx} | {t['baseline']:.0f} | {t['this checkout']:.0f} "
                          f"| {t['baseline'] / t['this checkout']:.2f}x |", flush=True)
        finally:
            cpu_attention._load = real_load


if __name__ == "__main__":
    main()
