"""``specserve bench``: plain decoding and proposers side by side on a prompt set, one run.

Every configuration answers the same prompts (Spec-Bench's JSONL format; default:
a shipped set of 3 questions from each of Spec-Bench's 13 categories) per category,
at each batch size and temperature, the configurations interleaved group by
group in rotating order so that machine noise hits all alike. Writes OUT/report.md
(tables, the command, machine facts), OUT/results.json (every number, per request
included) and PNG plots.

    specserve bench --configs plain,ngram:4,draft:3 --batch-sizes 1,8 --limit 1
    specserve bench --configs plain,ngram:4,eagle:4 --temperature 0,0.7 --peer transformers
    specserve bench --configs plain,ngram:4 --peer llama.cpp --llama-cpp-bin ~/.cache/specserve-peers/llama.cpp/build/bin
    specserve bench --configs ngram:5:tree,ngram:5 --stop-at-eos --peer transformers --transformers-dtype bfloat16,float32

Besides tok/s (prefill included, as Spec-Bench measures), the report gives each specserve
configuration's decode tok/s: the tokens after each request's first over the time after
its group's last first token.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmark plain decoding against proposers (and peers): report.md, results.json, plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target, anything `specserve generate --model` accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--configs", default="plain,ngram:4",
                   help="comma-separated: plain, ngram:K, draft:K, eagle:K, suffix:K (K draft tokens per step; "
                        "draft and eagle use the default model's shipped drafts unless --draft-model/--eagle-model); "
                        "options may follow as :dynamic (dynamic_k, n-gram's and suffix's default), :fixed (k every step), :tree (n-gram trees) or :KEY=VALUE for any "
                        "SpeculativeConfig field, e.g. ngram:5:prompt_lookup_max=5:tree,ngram:5:prompt_lookup_max=5 "
                        "(trees against chains); plain is always run (speedups are against it)")
    p.add_argument("--draft-model", default=None, help="the draft for draft:K configurations")
    p.add_argument("--eagle-model", default=None, help="the EAGLE head folder for eagle:K configurations")
    p.add_argument("--peer", action="append", default=[], choices=["transformers", "llama.cpp"],
                   help="also measure a peer engine on the same prompts (repeatable)")
    p.add_argument("--llama-cpp-bin", default=None,
                   help="folder with llama-server, built by ../shared/peers/build-llamacpp.sh "
                        "(default: ~/.cache/specserve-peers/llama.cpp/build/bin)")
    p.add_argument("--transformers-dtype", default="bfloat16",
                   help="dtype of the transformers peer; comma-separated for one peer per dtype "
                        "(named transformers-bf16, transformers-fp32, ...)")
    p.add_argument("--prompts", default=None, help="Spec-Bench-format JSONL (default: the shipped set)")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    p.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,8")
    p.add_argument("--temperature", default="0", help="comma-separated, e.g. 0,0.7 (0 = greedy)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="answers end at end-of-sequence (Spec-Bench's protocol) instead of always --max-tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes of KV cache per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (and llama.cpp's -t)")
    p.add_argument("--out", default=None, help="output folder (default: bench-results/<UTC timestamp>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)
    return p


def options_from_args(args, argv: list[str] | None = None):
    from specserve.bench.options import BenchOptions, parse_configs, parse_list

    batch_sizes = parse_list(args.batch_sizes, int)
    if any(b < 1 for b in batch_sizes):
        raise ValueError("--batch-sizes must be positive")
    temps = parse_list(args.temperature, float)
    if any(t < 0 for t in temps):
        raise ValueError("--temperature must be >= 0")
    argv = sys.argv[1:] if argv is None else argv
    return BenchOptions(
        model=args.model, dtype=args.dtype, device=args.device,
        configs=parse_configs(args.configs, args.draft_model, args.eagle_model),
        peers=list(dict.fromkeys(args.peer)), llama_cpp_bin=args.llama_cpp_bin,
        transformers_dtype=args.transformers_dtype,
        prompts_path=args.prompts,
        categories=[c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None,
        limit=args.limit, batch_sizes=list(dict.fromkeys(batch_sizes)), temperatures=list(dict.fromkeys(temps)),
        max_tokens=args.max_tokens, stop_at_eos=args.stop_at_eos, max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory, seed=args.seed, threads=args.threads,
        progress=not args.no_progress,
        command="specserve " + " ".join(shlex.quote(a) for a in argv),
    )


def cmd_bench(args, argv: list[str] | None = None) -> int:
    from specserve.bench.report import render_markdown, write_json
    from specserve.bench.runner import run_bench

    opts = options_from_args(args, argv)
    out = args.out or os.path.join(
        "bench-results", datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    doc = run_bench(opts)
    write_json(doc, os.path.join(out, "results.json"))
    plots = []
    if not args.no_plots:
        from specserve.bench.plots import write_plots

        plots = write_plots(doc, out)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(doc, plots))
    print(f"wrote {os.path.join(out, 'report.md')}, results.json" + (", " + ", ".join(plots) if plots else ""))
    return 0
