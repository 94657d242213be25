"""int8 activations in pieces against the float32-activation paths: forward time by row count and
how far each path's logits are from the float32 AVX-512 kernel's, one process.

Paths (each its own ``LLM`` of ``--model``, loaded once): ``AVX512`` (float32 activations on the
AVX-512 kernel, ``SPECSERVE_CPU_AMX=off``), ``AMX`` (float32 activations on AMX tiles, where the
CPU has them), ``int8`` (``int8_activations=True``), ``pN`` (``int8_activations=N``: each
activation row as N int8 pieces, ``cpu_kernels/q8_act.h``; ``p3`` on CPUs with AMX: on int8
tiles, ``cpu_kernels/amx_int8.h``), ``pN-vnni`` (``pN`` with ``SPECSERVE_CPU_AMX=off``: the
VNNI kernel on CPUs with AMX too). Forwards over one step's rows at
context 64 (1 = a decode step, k + 1 = a verification), paths alternated round by round; ms,
medians. Logits: one 40-token prompt's 40 rows, max |logit - AVX512's| and argmax agreement.

    python benchmarks/activation_pieces.py --model qwen2.5-coder-1.5b-instruct --rows 1,2,4,7 --paths AVX512,AMX,int8,p3,p3-vnni
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward_timing import print_table, time_forwards, with_amx  # noqa: E402  (the shared timing loop)


def build(model: str, path: str):
    from specserve import LLM
    vnni = path in ("AVX512", "int8") or path.endswith("-vnni")
    fixed = {"AVX512": False, "AMX": False, "int8": True}
    act = fixed[path] if path in fixed else int(path[1:].removesuffix("-vnni"))
    return with_amx(not vnni, lambda: LLM(model=model, max_model_len=1024, kv_cache_memory=1 << 27,
                                          int8_activations=act))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="catalog name or .gguf path (default: the default model)")
    p.add_argument("--rows", default="1,2,4,7")
    p.add_argument("--paths", default="AVX512,AMX,int8,p3,p3-vnni")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from specserve.worker.model_runner import ForwardInput

    paths = args.paths.split(",")
    llms = {path: build(args.model, path) for path in paths}
    prompt = list(range(1000, 1040))
    logits = {path: llm.engine.runner.execute([ForwardInput(prompt, 0, list(range(4)), len(prompt))]).logits.double()
              for path, llm in llms.items()}
    ref = logits[paths[0]]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {args.model or 'default model'}, {args.threads} threads")
    for path in paths:
        diff = (logits[path] - ref).abs().max().item()
        agree = (logits[path].argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"- {path}: max |logit - {paths[0]}'s| = {diff:.2e}, argmax agrees on {agree:.1%} of 40 rows")
    rows_list = [int(r) for r in args.rows.split(",")]
    print()
    print_table(time_forwards(llms, rows_list, args.rounds), paths, rows_list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
