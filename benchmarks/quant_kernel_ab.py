"""The GGUF-block kernels of this checkout against those of another git revision.

Builds ``cpu_kernels/quant_gemm.c`` and ``quant_layer.c`` (with their headers) as they
were at ``--baseline``, with this checkout's flags and compiler, next to this
checkout's, and times both in one process, alternated round by round:

``--matrices``: the quantized matmul alone on random blocks of a model's shapes
(``--shapes``: Qwen2.5-Coder-1.5B's by default, Q4_K q/k/v/o and gate/up, Q6_K down;
the 0.5B draft's, Q5_0 and Q8_0; the default model's, Q4_1), cycling
through enough copies that the weights stream from memory, for each row count
(1 = a decode step, k + 1 = a verification); G weight-rows/s (median). With ``--tiles``
the matrices are packed for AMX tiles (CPUs with AMX; the baseline must share this
checkout's packing), else they take the AVX-512/AVX2 path.

``--model NAME``: a model's forward over one decode step's rows (1, 2, 4, 5, 8 at
context 64) with each build, ms (median); the engine is built once per build, so
its one-call layer stack holds that build's library.

Both with ``--int8-activations`` or without (float32 activations).

    python benchmarks/quant_kernel_ab.py --baseline HEAD --matrices --int8-activations
    python benchmarks/quant_kernel_ab.py --baseline HEAD --model qwen2.5-coder-1.5b-instruct --int8-activations
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specserve.model_executor.layers import quant_gemm, quant_layer
from specserve.model_executor.layers.kernel_build import KERNEL_DIR

from forward_timing import print_table, time_forwards  # noqa: E402,I001  (benchmarks/: the shared timing loop)

HERE = Path(__file__).resolve().parent
# (name, ggml type, out features, in features): Qwen2.5-Coder-1.5B's matmuls of one layer
SHAPES = {
    "qwen2.5-coder-1.5b": [("qkv", 12, 2048, 1536), ("o", 12, 1536, 1536), ("gate_up", 12, 17920, 1536),
                           ("down", 14, 1536, 8960)],
    # the 0.5B draft: Q5_0 layers (Q8_0 v), Q6_K down, a Q8_0 LM head
    "qwen2.5-coder-0.5b": [("q", 6, 1024, 896), ("o", 6, 896, 896), ("gate_up", 6, 9728, 896), ("down", 14, 896, 4864),
                           ("lm_head", 8, 151936, 896)],
    # the default model, Q4_1 (576 values: a last group of 64), a Q8_0 LM head
    "smollm2-135m": [("qkv", 3, 960, 576), ("o", 3, 576, 576), ("gate_up", 3, 3072, 576), ("down", 3, 576, 1536),
                     ("lm_head", 8, 49152, 576)],
}


def build_baseline(revision: str, workdir: Path) -> dict[str, ctypes.CDLL]:
    """quant_gemm.c and quant_layer.c at ``revision`` (every cpu_kernels file of it), compiled."""
    repo = KERNEL_DIR.parents[3]
    rel = KERNEL_DIR.relative_to(repo)
    names = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", f"{revision}:{rel}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        (workdir / name).write_bytes(subprocess.run(["git", "-C", str(repo), "show", f"{revision}:{rel}/{name}"],
                                                    check=True, capture_output=True).stdout)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    libs = {}
    for source, module in (("quant_gemm.c", quant_gemm), ("quant_layer.c", quant_layer)):
        target = workdir / source.replace(".c", "_baseline.so")
        subprocess.run([compiler, *quant_gemm.COMPILE_FLAGS, "-I", str(workdir), "-shared", "-fPIC",
                        str(workdir / source), "-o", str(target), "-fopenmp", "-lm"], check=True)
        lib = ctypes.CDLL(str(target))
        module._setup(lib)
        libs[source] = lib
    return libs


def use(libs: dict[str, ctypes.CDLL]) -> None:
    """Make every later kernel call (and every layer stack built from now on) use these builds."""
    for source, module in (("quant_gemm.c", quant_gemm), ("quant_layer.c", quant_layer)):
        module.LIBRARY.library, module.LIBRARY.attempted = libs[source], True


def matrices(builds: dict, shapes, rows_list, rounds: int, int8: bool, tiles: bool = False) -> None:
    sys.path.insert(0, str(HERE.parent / "tests" / "model_executor" / "layers"))
    from test_quant_gemm import random_blocks

    from specserve.model_executor.layers.quantized import QuantizedMatrix

    # enough copies of each shape that one pass streams ~256 MB: weights come from memory
    mats = []
    for name, qt, out_f, in_f in shapes:
        one = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(qt, out_f, in_f, seed=1)), qt, in_f)
        copies = max(1, (256 << 20) // max(1, one.segments[0].data.numel()) // len(shapes))
        group = []
        for _ in range(copies):
            m = QuantizedMatrix.from_blocks(one.segments[0].data.clone(), qt, in_f)
            m.int8_activations = int8
            group.append(m.packed_for_tiles() if tiles else m)   # the same packing in both builds
        mats.append((name, out_f, in_f, group))
    print(f"| matrix | rows | " + " | ".join(builds) + " | ratio |\n|---|---|" + "---|" * (len(builds) + 1))
    for name, out_f, in_f, group in mats:
        for rows in rows_list:
            x = torch.randn(rows, in_f)
            for libs in builds.values():   # warm: each build's code and every copy touched once
                use(libs)
                for m in group:
                    m.matmul(x)
            times: dict[str, list[float]] = {b: [] for b in builds}
            for _ in range(rounds):
                for b, libs in builds.items():
                    use(libs)
                    start = time.perf_counter()
                    for m in group:
                        m.matmul(x)
                    times[b].append(out_f * in_f * rows * len(group) / (time.perf_counter() - start) / 1e9)
            med = {b: statistics.median(t) for b, t in times.items()}
            names = list(builds)
            print(f"| {name} [{out_f}, {in_f}] | {rows} | " + " | ".join(f"{med[b]:.1f}" for b in names)
                  + f" | {med[names[-1]] / med[names[0]]:.2f}x |", flush=True)


def model_forward(builds: dict, model: str, rows_list, rounds: int, int8: bool) -> None:
    from specserve import LLM

    llms = {}
    for b, libs in builds.items():
        use(libs)
        llms[b] = LLM(model=model, max_model_len=1024, kv_cache_memory=1 << 27, int8_activations=int8)
    names = list(builds)
    medians = time_forwards(llms, rows_list, rounds, before=lambda b: use(builds[b]))
    print_table(medians, names, rows_list, ratio=(names[0], names[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision whose kernels are the baseline")
    p.add_argument("--matrices", action="store_true")
    p.add_argument("--model", default=None, help="a catalog name or path: forward time by row count")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="qwen2.5-coder-1.5b")
    p.add_argument("--int8-activations", action="store_true")
    p.add_argument("--tiles", action="store_true",
                   help="--matrices packed for AMX tiles (this checkout's packing, which the baseline must share)")
    p.add_argument("--rows", default="1,2,4,5,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        builds = {f"baseline {args.baseline}": build_baseline(args.baseline, Path(tmp)),
                  "this checkout": {"quant_gemm.c": quant_gemm.LIBRARY.get(), "quant_layer.c": quant_layer.LIBRARY.get()}}
        print(f"{'int8' if args.int8_activations else 'float32'} activations, {args.threads} threads, "
              f"{args.rounds} rounds alternated; ratio = this checkout over the baseline (above 1: faster)")
        if args.matrices:
            matrices(builds, SHAPES[args.shapes], rows_list, args.rounds, args.int8_activations, args.tiles)
        if args.model:
            model_forward(builds, args.model, rows_list, args.rounds, args.int8_activations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
