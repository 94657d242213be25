"""A bounded load test of the OpenAI-compatible server on loopback: plain against speculation.

Sends ``--num-requests`` streaming chat requests, ``--concurrency`` in flight at once, to a
``specserve serve`` started here in a subprocess, once per configuration (``--configs``: ``plain``
and ``METHOD:K`` for ngram, suffix, eagle or draft_model), one server after the other on the same
prompts (the first turns of Spec-Bench's questions, cycled). ``llama.cpp`` among the configurations
starts llama.cpp's ``llama-server`` instead (a peer measured from outside: the same GGUF file,
``--concurrency`` slots of ``--max-model-len`` tokens each, ``--threads`` threads) and measures it
with the same client and requests. Reported per configuration: output throughput, TTFT and TPOT
percentiles, acceptance (from the server's ``/metrics``), and each configuration's throughput
against plain (and against llama.cpp's, when it ran). ``--url`` measures a server that is already
running. ``--lora FILE --loras N``: request i runs with adapter i mod N of N copies of one LoRA file
(distinct adapters to each server): specserve's by name (``--lora-modules``, ``--max-loras N``),
llama-server's by its ``lora`` list (``--lora`` N times, ``--lora-init-without-apply``).
"""
from __future__ import annotations

import json

import os

from specserve.bench.results import fmt
from specserve.bench.suites.llama_bench import DEFAULT_LLAMA_BIN

COLUMNS = ["configuration", "requests", "failed", "output tok/s", "vs plain", "TTFT p50 ms", "TTFT p90 ms",
           "TPOT p50 ms", "TPOT p90 ms", "acceptance", "tau"]
PEER = "llama.cpp"    # the configuration that measures llama-server


def add_arguments(p) -> None:
    p.add_argument("--configs", default="plain,ngram:4",
                   help="comma-separated: plain, METHOD:K (ngram, suffix, eagle, draft_model) and llama.cpp "
                        "(llama-server with --concurrency slots)")
    p.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN, help="folder with llama.cpp's llama-server")
    p.add_argument("--url", default=None, help="an already running server (default: start one per configuration)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--prompts", default="spec-bench", help="Spec-Bench-format JSONL ('spec-bench': the shared copy)")
    p.add_argument("--num-requests", "-n", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stop-at-eos", action="store_true", help="answers end at end-of-sequence (default: max tokens)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--model", default=None)
    p.add_argument("--speculative-model", default=None, help="the draft of draft_model:K")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--server-log", default=None, help="append the servers' output to this file")
    p.add_argument("--lora", default=None, metavar="FILE", help="a LoRA adapter (llama.cpp .gguf) the requests use")
    p.add_argument("--loras", type=int, default=4, help="with --lora: that many distinct adapters, one per request in turn")


def load_prompts(path: str, n: int) -> list[str]:
    """The first turns of the file's questions, cycled to ``n``."""
    from specserve.bench.options import prompts_path

    prompts = []
    with open(prompts_path(path)) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                prompts.append(row["turns"][0] if row.get("turns") else row["prompt"])
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return [prompts[i % len(prompts)] for i in range(n)]


def server_args(config: str, args) -> list[str]:
    """``specserve serve`` flags for ``plain`` or ``METHOD:K``."""
    if config == "plain":
        from specserve.entrypoints.engine_args import NO_SPECULATION_FLAG

        return [NO_SPECULATION_FLAG] if NO_SPECULATION_FLAG else []
    method, _, k = config.partition(":")
    extra = ["--speculative-method", method] + (["--num-speculative-tokens", k] if k else [])
    if method == "draft_model" and args.speculative_model:
        extra += ["--speculative-model", args.speculative_model]
    return extra


def lora_server_args(args) -> list[str]:
    """``specserve serve`` flags for ``--lora``: the file under ``--loras`` names."""
    if not args.lora:
        return []
    return ["--lora-modules", *(f"lora{i}={os.path.abspath(args.lora)}" for i in range(args.loras)),
            "--max-loras", str(args.loras), "--max-cpu-loras", str(args.loras)]


def lora_fields(args, peer: bool):
    """Request i's adapter (None without ``--lora``): llama-server's ``lora`` list, or specserve's name."""
    if not args.lora:
        return None
    if peer:
        return lambda i: {"lora": [{"id": i % args.loras, "scale": 1.0}]}
    return lambda i: {"model": f"lora{i % args.loras}"}


def run(args, doc: dict) -> None:
    from specserve.bench import load_client as lc

    if args.suite == "lora-load" and not args.lora:
        raise SystemExit("specserve bench lora-load: --lora ADAPTER.gguf is needed (benchmarks/lora_demo.py writes one)")
    args.ignore_eos = not args.stop_at_eos
    doc["params"] = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    prompts = load_prompts(args.prompts, args.num_requests)
    reports = []
    if args.url:
        reports.append(lc.measure("server", args.url.rstrip("/"), prompts, args))
    else:
        for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
            reports.append(_measure_llama_server(prompts, args) if config == PEER
                           else _measure_specserve(config, prompts, args))
    summaries = [r.summary() for r in reports]
    plain = next((s["output_tok_per_s"] for s in summaries if s["label"] == "plain"), None)
    peer = next((s["output_tok_per_s"] for s in summaries if s["label"] == PEER), None)
    columns = COLUMNS + (["vs llama.cpp"] if peer else [])
    rows = []
    for s in summaries:
        up = s["output_tok_per_s"] / plain if plain and s["label"] != "plain" else None
        row = [f"`{s['label']}`", str(s["requests"]), str(s["failed"]), fmt(s["output_tok_per_s"]),
               fmt(up, 2, "x"), fmt(s["ttft_p50_ms"], 0), fmt(s["ttft_p90_ms"], 0), fmt(s["tpot_p50_ms"]),
               fmt(s["tpot_p90_ms"]), fmt(s.get("acceptance_rate"), 2), fmt(s.get("mean_acceptance_length"), 2)]
        if peer:
            row.append(fmt(s["output_tok_per_s"] / peer, 2, "x") if s["label"] != PEER else "—")
        rows.append(row)
    doc["table"] = {"columns": columns, "rows": rows}
    doc["notes"] = [f"{args.num_requests} streaming {args.endpoint} requests, {args.concurrency} in flight, "
                    f"{args.max_tokens} tokens each" + (" at most" if args.stop_at_eos else " (end-of-sequence ignored)")
                    + f", temperature {args.temperature:g}; one server per configuration, one after the other."
                    + (f" Request i runs with LoRA adapter i mod {args.loras} ({args.loras} adapters, each a copy of "
                       f"{os.path.basename(args.lora)})." if args.lora else "")]
    if peer:
        doc["notes"].append(f"llama.cpp: llama-server on the same GGUF file, {args.concurrency} slots of "
                            f"{args.max_model_len} tokens, {_llama_threads(args)} threads (acceptance and tau are "
                            f"specserve's speculation counters; llama-server does not speculate here).")
    doc["samples"] = {"summaries": summaries,
                      "requests": {r.label: [vars(x) for x in r.results] for r in reports}}
    if any(s["failed"] for s in summaries):
        raise RuntimeError(f"failed requests: {[(s['label'], s['failed']) for s in summaries]}")


def _measure_specserve(config: str, prompts: list[str], args):
    from specserve.bench import load_client as lc

    server = lc.ServerProcess(server_args(config, args) + lora_server_args(args), args)
    try:
        server.wait_ready(args.startup_timeout)
        return lc.measure(config, server.url, prompts, args, lora_fields(args, peer=False))
    finally:
        server.stop()


def _llama_threads(args) -> int:
    return args.threads or os.cpu_count() or 1


def _measure_llama_server(prompts: list[str], args):
    """llama-server with one slot per request in flight (its continuous batching), same requests."""
    from specserve.bench import load_client as lc
    from specserve.bench.peers import gguf_path, start_llama_server, stop_process

    exe = os.path.join(os.path.expanduser(args.llama_bin), "llama-server")
    if not os.path.isfile(exe):
        raise RuntimeError(f"{exe} not found: build llama.cpp's tools with ../shared/peers/build-llamacpp.sh, or "
                           f"leave {PEER} out of --configs")
    log = open(args.server_log, "a") if args.server_log else open(os.devnull, "w")
    with log:
        loras = [a for _ in range(args.loras) for a in ("--lora", os.path.abspath(args.lora))] if args.lora else []
        server, base = start_llama_server(exe, gguf_path(args.model), _llama_threads(args),
                                          ctx_size=args.concurrency * args.max_model_len, slots=args.concurrency,
                                          log=log, timeout_s=args.startup_timeout,
                                          extra_args=loras + (["--lora-init-without-apply"] if loras else []))
        try:
            return lc.measure(PEER, base, prompts, args, lora_fields(args, peer=True))
        finally:
            stop_process(server)
