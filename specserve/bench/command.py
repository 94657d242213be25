"""``specserve bench [SUITE]``: every figure specserve publishes, one suite per question.

Each run prints its table and writes one results file, RESULTS/<suite>/<UTC time>.json.gz
(``--results``, default bench-results/): the machine's facts, the command, the commit, the table
and the raw samples;
``specserve bench page`` turns the newest file of each suite under docs/bench/results into
docs/benchmarks.md. The suites: ``specserve bench --help`` lists them, ``specserve bench SUITE
--help`` gives their options.

Without a suite (spec-bench): plain decoding and proposers side by side. Every configuration
answers the same prompts (Spec-Bench's JSONL format; default: a shipped set of 3 questions from
each of Spec-Bench's 13 categories) per category, at each batch size and temperature, the
configurations interleaved group by group in rotating order so that machine noise hits all
alike. ``--out DIR`` also writes DIR/report.md (tables per category), DIR/results.json and PNG
plots.

    specserve bench --configs plain,ngram:4,draft:3 --batch-sizes 1,8 --limit 1
    specserve bench --configs plain,ngram:4,eagle:4 --temperature 0,0.7 --peer transformers
    specserve bench --configs plain,ngram:4 --peer llama.cpp --llama-cpp-bin ~/.cache/specserve-peers/llama.cpp/build/bin
    specserve bench --configs ngram:5:tree,ngram:5 --stop-at-eos --peer transformers --transformers-dtype bfloat16,float32
    specserve bench batch-scaling            # a preset: plain against n-gram at batches 1, 8, 32, 64
    specserve bench llama-bench --models default,qwen2.5-coder-1.5b-instruct

Besides tok/s (prefill included, as Spec-Bench measures), spec-bench gives each specserve
configuration's decode tok/s: the tokens after each request's first over the time after
its group's last first token.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys


SPEC_BENCH_DEFAULTS = {"configs": "plain,ngram:4", "batch_sizes": "1", "prompts": None, "categories": None,
                       "limit": None, "max_tokens": 128, "device": None, "peer": None, "threads": None}
PRESETS = {   # suites that are spec-bench with other defaults
    "batch-scaling": {"configs": "plain,ngram:4", "batch_sizes": "1,8,32,64", "prompts": "spec-bench",
                      "categories": "writing,coding,math_reasoning,summarization,translation,rag", "limit": 2,
                      "max_tokens": 64, "threads": 2},
    "cross-vocab": {"model": "qwen2.5-coder-1.5b-instruct", "draft_model": "qwen2.5-coder-0.5b-instruct",
                    "configs": "plain,ngram:4,draft:4,draft:4:cross_vocab=tli,draft:3:model=smollm2-135m-instruct,"
                               "draft:3:model=gemma-3-270m",
                    "prompts": "coding+spec-bench", "categories": "write,refactor,explain,complete,fix,coding,qa",
                    "limit": 2, "max_tokens": 96, "threads": 2},
    # draft-model trees against chains of 3-5 on the real pair (~35 min on 2 cores); 256 MiB of KV
    # cache per configuration (one request at a time) keeps the nine engines in about 19 GiB
    "draft-trees": {"model": "qwen2.5-coder-1.5b-instruct", "draft_model": "qwen2.5-coder-0.5b-instruct",
                    "configs": "plain,draft:3,draft:4,draft:5,draft:4:tree=2/6,draft:5:tree=2/6,draft:5:tree=4/12/topk,"
                               "draft:5:tree=4/12/sampled,draft:5:tree=2/8/dynamic",
                    "prompts": "coding+spec-bench", "categories": "write,refactor,explain,complete,fix,coding,qa,writing",
                    "limit": 1, "max_tokens": 64, "threads": 2, "temperature": "0,0.7", "kv_cache_memory": 1 << 28},
    "fill-in-middle": {"model": "qwen2.5-coder-1.5b-instruct", "draft_model": "qwen2.5-coder-0.5b-instruct",
                       "configs": "plain,ngram:4,draft:3,draft:4", "prompts": "fill-in-middle", "max_tokens": 96,
                       "stop_at_eos": True, "threads": 2, "temperature": "0", "kv_cache_memory": 1 << 28},
    "gpu": {"configs": "plain,ngram:4,eagle:4", "batch_sizes": "1,8", "limit": 1, "max_tokens": 96,
            "device": "cuda", "peer": ["transformers"]},
}
SUITE_DEFAULTS = {   # other suites that are another suite's module with other defaults
    "lora-load": {"configs": "plain,llama.cpp"},
    # the GPU's step times: the 8B shape's decode and verification with and without graphs, the
    # 1B shape's 4-step draft chain against it, the 1.5B shape, against 4.8 TB/s and transformers
    "gpu-steps": {"models": "shape:llama-3.1-8b,shape:llama-3.1-8b:eager,shape:llama-3.2-1b,shape:qwen2.5-1.5b,"
                            "shape:qwen2.5-1.5b:eager", "rows": "1,5,8,13", "rounds": 2, "chain_steps": 4,
                  "device": "cuda", "dtype": "bfloat16", "memory_bandwidth": 4800.0, "peer": "transformers"},
}


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """``specserve bench``: the spec-bench suite's options, and one subcommand per suite (and ``page``)."""
    from specserve.bench.suites import SUITES

    p = sub.add_parser("bench", help="measure: spec-bench (default) or another suite; writes a results file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_bench_options(p, SPEC_BENCH_DEFAULTS)
    suites = p.add_subparsers(dest="suite", metavar="SUITE")
    for name, suite in SUITES.items():
        sp = suites.add_parser(name, help=suite.question, description=suite.question)
        if suite.module == "spec_bench":
            add_spec_bench_options(sp, {**SPEC_BENCH_DEFAULTS, **PRESETS.get(name, {})})
        else:
            from specserve.bench.suites import suite_module

            suite_module(name).add_arguments(sp)
            sp.set_defaults(**SUITE_DEFAULTS.get(name, {}))
            add_common_options(sp)
    page = suites.add_parser("page", help="regenerate docs/benchmarks.md from the newest results file of each suite")
    from specserve.bench.page import DEFAULT_PAGE, DEFAULT_RESULTS, DEFAULT_SCRIPTS

    page.add_argument("--results", default=DEFAULT_RESULTS, help="folder of results files (one folder per suite)")
    page.add_argument("--out", default=DEFAULT_PAGE)
    page.add_argument("--scripts", default=DEFAULT_SCRIPTS, help="folder whose scripts the page lists in one line each")
    page.add_argument("--check", action="store_true", help="only check that --out is what the results give")
    p.set_defaults(func=cmd_bench)
    return p


def add_common_options(p: argparse.ArgumentParser) -> None:
    from specserve.bench.results import DEFAULT_RESULTS_DIR

    p.add_argument("--results", default=DEFAULT_RESULTS_DIR,
                   help="folder for the results file (written as RESULTS/<suite>/<UTC time>.json.gz)")
    if not any(a.dest == "threads" for a in p._actions):
        p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")


def add_spec_bench_options(p: argparse.ArgumentParser, d: dict) -> None:
    p.add_argument("--model", default=d.get("model"), help="the target, anything `specserve generate --model` accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=d["device"], help="cpu or cuda (default: cuda when available)")
    p.add_argument("--configs", default=d["configs"],
                   help="comma-separated: plain, ngram:K, draft:K, eagle:K, suffix:K (K draft tokens per step; "
                        "draft and eagle use the default model's shipped drafts unless --draft-model/--eagle-model); "
                        "options may follow as :dynamic (dynamic_k, n-gram's and suffix's default), :fixed (k every step), :tree (n-gram trees) or :KEY=VALUE for any "
                        "SpeculativeConfig field, e.g. ngram:5:prompt_lookup_max=5:tree,ngram:5:prompt_lookup_max=5 "
                        "(trees against chains); plain is always run (speedups are against it)")
    p.add_argument("--draft-model", default=d.get("draft_model"), help="the draft for draft:K configurations")
    p.add_argument("--eagle-model", default=None, help="the EAGLE head folder for eagle:K configurations")
    p.add_argument("--eagle3-model", default=None, help="the EAGLE-3 head folder (vLLM's format) for eagle3:K "
                                                        "configurations")
    p.add_argument("--peer", action="append", default=d["peer"],
                   choices=["transformers", "transformers-assisted", "transformers-ngram", "llama.cpp"],
                   help="also measure a peer engine on the same prompts (repeatable): transformers' generate "
                        "plain, with --draft-model as its assistant_model, or with prompt lookup "
                        "(prompt_lookup_num_tokens=4; both one prompt at a time, as transformers requires)")
    p.add_argument("--llama-cpp-bin", default=None,
                   help="folder with llama-server, built by ../shared/peers/build-llamacpp.sh "
                        "(default: ~/.cache/specserve-peers/llama.cpp/build/bin)")
    p.add_argument("--transformers-dtype", default="bfloat16",
                   help="dtype of the transformers peer; comma-separated for one peer per dtype "
                        "(named transformers-bf16, transformers-fp32, ...)")
    p.add_argument("--prompts", default=d["prompts"],
                   help="Spec-Bench-format JSONL; 'spec-bench' for ../shared/data/spec_bench/question.jsonl, "
                        "'coding' for the 20 coding prompts; several joined by + (default: the shipped set)")
    p.add_argument("--categories", default=d["categories"], help="comma-separated categories to keep")
    p.add_argument("--limit", type=int, default=d["limit"], help="at most N prompts per category")
    p.add_argument("--batch-sizes", default=d["batch_sizes"], help="comma-separated, e.g. 1,8")
    p.add_argument("--temperature", default=d.get("temperature", "0"), help="comma-separated, e.g. 0,0.7 (0 = greedy)")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"], help="new tokens per request")
    p.add_argument("--stop-at-eos", action="store_true", default=d.get("stop_at_eos", False),
                   help="answers end at end-of-sequence (Spec-Bench's protocol; a fill-in-the-middle task's at its "
                        "end-of-middle tokens) instead of always --max-tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=d.get("kv_cache_memory", 1 << 30),
                   help="bytes of KV cache per configuration")
    p.add_argument("--int8-activations", default="off",
                   help="the target's activations in every configuration: off (float32), on (int8, one piece a "
                        "value) or a piece count 2-4 (LLM's int8_activations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=d["threads"], help="torch.set_num_threads (and llama.cpp's -t)")
    p.add_argument("--out", default=None, help="also write report.md, results.json and plots to this folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common_options(p)


def options_from_args(args, argv: list[str] | None = None):
    from specserve.bench.options import BenchOptions, parse_configs, parse_int8_activations, parse_list

    batch_sizes = parse_list(args.batch_sizes, int)
    if any(b < 1 for b in batch_sizes):
        raise ValueError("--batch-sizes must be positive")
    temps = parse_list(args.temperature, float)
    if any(t < 0 for t in temps):
        raise ValueError("--temperature must be >= 0")
    argv = sys.argv[1:] if argv is None else argv
    return BenchOptions(
        model=args.model, dtype=args.dtype, device=args.device,
        configs=parse_configs(args.configs, args.draft_model, args.eagle_model,
                              eagle3_model=getattr(args, "eagle3_model", None)),
        peers=list(dict.fromkeys(args.peer or [])), draft_model=args.draft_model, llama_cpp_bin=args.llama_cpp_bin,
        transformers_dtype=args.transformers_dtype,
        prompts_path=args.prompts,
        categories=[c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None,
        limit=args.limit, batch_sizes=list(dict.fromkeys(batch_sizes)), temperatures=list(dict.fromkeys(temps)),
        max_tokens=args.max_tokens, stop_at_eos=args.stop_at_eos, max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory, int8_activations=parse_int8_activations(args.int8_activations),
        seed=args.seed, threads=args.threads,
        progress=not args.no_progress,
        command="specserve " + " ".join(shlex.quote(a) for a in argv),
    )


def cmd_bench(args, argv: list[str] | None = None) -> int:
    """Run the suite ``args.suite`` (spec-bench when none), write its results file and print its table;
    or ``page``."""
    from specserve.bench import results
    from specserve.bench.suites import SUITES, suite_module

    if args.suite == "page":
        from specserve.bench.page import main

        return main(args)
    name = args.suite or "spec-bench"
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    argv = sys.argv[1:] if argv is None else argv
    doc = results.new_results(name, SUITES[name].question, "specserve " + " ".join(shlex.quote(a) for a in argv), {})
    suite_module(name).run(args, doc)
    if hasattr(os, "getloadavg") and not doc["machine"].get("loadavg_end"):
        doc["machine"]["loadavg_end"] = list(os.getloadavg())
    path = results.save(doc, args.results)
    print("\n".join(["", *results.table_lines(doc), ""]))
    print(f"wrote {path}")
    return 0
