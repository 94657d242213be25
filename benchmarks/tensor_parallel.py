"""Tensor parallelism benchmark: TP 1 vs TP N in one run, on the same prompts.

For each TP size the engine is built, warmed up (one short generation), then
runs the prompts at batch 1 (one request at a time) and as one batch of B
(all in flight together), greedy, every request exactly ``--max-tokens`` new
tokens (``ignore_eos``). Reported per run: output tokens/s (all new tokens /
wall time), start-up time, weight bytes per rank (each rank's parameters) and
peak RSS per rank (VmHWM). Each TP size runs in a fresh Python process, one
after the other, so memory figures are its own; on a shared machine compare
the speeds with care.

    python benchmarks/tensor_parallel.py --tp 3              # the default model: 9 heads, 3 kv heads
    python benchmarks/tensor_parallel.py --tp 3 --tp1-threads 1 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPTS = os.path.join(HERE, "prompts", "default.jsonl")


def load_prompts(path: str, n: int) -> list[str]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def run_engine(args, tp: int, prompts: list[str]) -> dict:
    from specserve import LLM, SamplingParams

    saved_threads = torch.get_num_threads()
    if tp == 1 and args.tp1_threads:
        torch.set_num_threads(args.tp1_threads)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory, tensor_parallel_size=tp)
    startup = time.perf_counter() - t0
    runner = llm.engine.runner
    if tp == 1:
        from specserve.worker.tp_executor import peak_rss_bytes

        weights = [sum(p.numel() * p.element_size() for p in runner.model.parameters())]
        rss = [peak_rss_bytes()]
    else:
        weights, rss = runner.weight_bytes_per_rank, runner.peak_rss_per_rank
    chat = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(chat[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    result = {"tp": tp, "threads_per_rank": torch.get_num_threads(), "startup_s": round(startup, 1),
              "weight_mib_per_rank": [mib(b) for b in weights], "peak_rss_mib_per_rank": [mib(b) for b in rss]}
    for batch in args.batch_sizes:
        group = chat[: args.batch1_prompts] if batch == 1 else chat[:batch]
        t0 = time.perf_counter()
        tokens = 0
        outputs = []
        for i in range(0, len(group), batch):
            outs = llm.generate(group[i : i + batch], params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            outputs += [o.outputs[0].token_ids for o in outs]
        wall = time.perf_counter() - t0
        result[f"batch_{batch}"] = {"requests": len(group), "new_tokens": tokens, "wall_s": round(wall, 2),
                                    "tok_per_s": round(tokens / wall, 2), "token_ids": outputs}
    if tp > 1:
        runner.shutdown()
    torch.set_num_threads(saved_threads)
    return result


def run_in_subprocess(argv: list[str], tp: int) -> dict:
    """One TP size in a fresh interpreter: its memory figures are its own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--single-tp", str(tp), "--json", f.name],
                       check=True)
        with open(f.name) as fh:
            return json.load(fh)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--tp", type=int, default=3, help="the TP size compared with TP 1")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--batch1-prompts", type=int, default=2, help="prompts run one at a time for batch 1")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 27, help="bytes per rank")
    p.add_argument("--tp1-threads", type=int, default=None, help="torch threads for TP 1 (default: torch's)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--single-tp", type=int, default=None, help=argparse.SUPPRESS)  # internal: one run
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.single_tp is not None:
        prompts = load_prompts(args.prompts, max(args.batch_sizes + [args.batch1_prompts]))
        with open(args.json, "w") as f:
            json.dump(run_engine(args, args.single_tp, prompts), f)
        return 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    passthrough = [
        "--tp", str(args.tp), "--dtype", args.dtype, "--max-tokens", str(args.max_tokens),
        "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--batch1-prompts", str(args.batch1_prompts),
        "--prompts", args.prompts, "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory", str(args.kv_cache_memory),
    ] + (["--model", args.model] if args.model else []) + (
        ["--tp1-threads", str(args.tp1_threads)] if args.tp1_threads else [])
    runs = [run_in_subprocess(passthrough, tp) for tp in (1, args.tp)]
    same = {f"batch_{b}": runs[0][f"batch_{b}"]["token_ids"] == runs[1][f"batch_{b}"]["token_ids"]
            for b in args.batch_sizes}
    doc = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "cpu_count": os.cpu_count(),
           "machine": platform.machine(), "torch": torch.__version__, "load_avg_at_start": load,
           "dtype": args.dtype, "max_tokens": args.max_tokens, "same_tokens_as_tp1": same, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print("| TP | threads/rank | start-up (s) | weights per rank (MiB) | peak RSS per rank (MiB) | "
          + " | ".join(f"batch {b} tok/s" for b in args.batch_sizes) + " |")
    print("|---" * (5 + len(args.batch_sizes)) + "|")
    for r in runs:
        print(f"| {r['tp']} | {r['threads_per_rank']} | {r['startup_s']} | {r['weight_mib_per_rank']} | "
              f"{r['peak_rss_mib_per_rank']} | " + " | ".join(str(r[f'batch_{b}']['tok_per_s']) for b in args.batch_sizes) + " |")
    print(f"same greedy tokens as TP 1: {same}; load average at start: {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
