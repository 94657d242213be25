"""The benchmark command is ``specserve bench`` (specserve/bench/); this script only maps its old options onto it.

Kept so that the commands in docs/benchmarks.md still run: ``--speculative-*`` and ``--prompt-lookup-*``
become one bench configuration (``--compare-chain`` adds it without ``:tree``), ``--baseline transformers
--baseline-dtypes D1,D2`` becomes ``--peer transformers --transformers-dtype D1,D2``, ``--limit-per-category``
``--limit``, ``--kv-cache-gb`` ``--kv-cache-memory``; old defaults stay (batch sizes 1,16,
benchmarks/prompts/default.jsonl); other options (``--out DIR``, ``--no-plots``) pass through.

    python benchmarks/benchmark.py --speculative-method ngram --num-speculative-tokens 4 --prompt-lookup-max 3
    # = specserve bench --configs plain,ngram:4:prompt_lookup_max=3 --batch-sizes 1,16 --prompts ...
"""
from __future__ import annotations

import argparse
import os
import sys

from specserve.bench.runner import load_prompts   # benchmarks/ngram_draft_length.py imports it from here

__all__ = ["DEFAULT_PROMPTS", "bench_argv", "load_prompts"]
DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts", "default.jsonl")
SAME = ("prompts", "batch_sizes", "categories", "max_tokens", "dtype", "model", "temperature", "max_model_len",
        "seed", "threads")
SPEC = ("prompt_lookup_min", "prompt_lookup_max", "prompt_lookup_adaptive", "disable_by_batch_size")


def bench_argv(argv: list[str] | None = None) -> list[str]:
    """The ``specserve bench`` options (without ``bench``) an old ``benchmark.py`` command line means."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--batch-sizes", default="1,16")
    for name in SAME[2:] + SPEC[:2] + ("limit_per_category", "kv_cache_gb", "speculative_method", "speculative_model",
                                       "num_speculative_tokens", "json_out"):
        ap.add_argument("--" + name.replace("_", "-"), dest=name, default=None)
    ap.add_argument("--speculative-disable-by-batch-size", dest="disable_by_batch_size", default=None)
    for name in ("--prompt-lookup-adaptive", "--prompt-lookup-tree"):
        ap.add_argument(name, action=argparse.BooleanOptionalAction, default=None)
    for name in ("--stop-at-eos", "--compare-chain"):
        ap.add_argument(name, action="store_true")
    ap.add_argument("--baseline", choices=["transformers", "none"], default="none")
    ap.add_argument("--baseline-dtypes", default="bfloat16")
    a, rest = ap.parse_known_args(argv)
    if a.json_out is not None:
        ap.error("--json-out is gone: use --out DIR (specserve bench writes DIR/results.json and DIR/report.md)")
    out = [x for n in SAME if getattr(a, n) is not None for x in ("--" + n.replace("_", "-"), getattr(a, n))]
    out += ["--limit", a.limit_per_category] if a.limit_per_category else []
    out += ["--kv-cache-memory", str(int(float(a.kv_cache_gb) * (1 << 30)))] if a.kv_cache_gb else []
    out += ["--stop-at-eos"] if a.stop_at_eos else []
    out += ["--peer", "transformers", "--transformers-dtype", a.baseline_dtypes] if a.baseline == "transformers" else []
    opts = [f"{n}={str(getattr(a, n)).lower()}" for n in SPEC if getattr(a, n) is not None]
    method = a.speculative_method or ("draft_model" if a.speculative_model else None)
    if method is None and (opts or a.num_speculative_tokens or a.prompt_lookup_tree or a.compare_chain):
        ap.error("speculative options need --speculative-method (in bench: --configs METHOD:K:KEY=VALUE)")
    if a.compare_chain and not a.prompt_lookup_tree:
        ap.error("--compare-chain needs --speculative-method ngram --prompt-lookup-tree")
    if a.speculative_model and method not in ("draft_model", "eagle"):
        ap.error(f"--speculative-model is for draft_model or eagle, not {method}")
    if a.speculative_model:
        out += ["--eagle-model" if method == "eagle" else "--draft-model", a.speculative_model]
    chain = method and ":".join([method] + ([a.num_speculative_tokens] if a.num_speculative_tokens else []) + opts)
    configs = ["plain"] + ([chain + ":tree" if a.prompt_lookup_tree else chain] if method else [])
    return out + ["--configs", ",".join(configs + ([chain] if a.compare_chain else []))] + rest


if __name__ == "__main__":
    from specserve.bench.cli import main

    sys.exit(main(bench_argv()))
