"""Code completion as an editor asks for it: specserve's ``/infill`` against llama-server's.

The 12 fill-in-the-middle tasks (``benchmarks/prompts/fill_in_middle.jsonl``: a Python
function's prefix and the code after the gap) are sent one at a time, as an editor does, to
``POST /infill`` of each configuration's server, all started here on the same GGUF files: a
``specserve serve`` per specserve configuration (``plain``, ``draft:K`` with the draft model,
``ngram:K``, ``suffix:K``; ``:int8`` after any of them runs it with ``--int8-activations``)
and llama.cpp's ``llama-server`` (``llama.cpp``: plain; ``llama.cpp+draft:K``: with the same
draft, ``--spec-type draft-simple --spec-draft-n-max K``), each measured from outside over
HTTP. Greedy, ``n_predict`` at most ``--max-tokens``, answers ending at the end of the middle.
Task by task the servers answer in rotating order. Reported per configuration: the median and
90th-percentile latency of a completion (request to whole answer), tokens a second (predicted
tokens over the latencies), the ratio of median latencies to llama-server's plain and draft
configurations, and how many answers equal specserve plain's (greedy: speculation must not
change them) and llama-server's plain (another engine's numerics may).
"""
from __future__ import annotations

import os
import statistics
import time

from specserve.bench.results import fmt
from specserve.bench.suites.llama_bench import DEFAULT_LLAMA_BIN

PEER = "llama.cpp"
COLUMNS = ["configuration", "median latency ms", "p90 latency ms", "tok/s", "vs llama.cpp", "vs llama.cpp+draft",
           "same as plain", "same as llama.cpp", "draft acceptance"]


def add_arguments(p) -> None:
    p.add_argument("--configs", default="plain,draft:4,ngram:4,llama.cpp,llama.cpp+draft:3",
                   help="comma-separated: plain, draft:K, ngram:K, suffix:K (specserve; ':int8' adds "
                        "--int8-activations, e.g. draft:4:int8), llama.cpp, llama.cpp+draft:K (llama-server)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN, help="folder with llama.cpp's llama-server")
    p.add_argument("--prompts", default="fill-in-middle", help="JSONL of tasks with a prefix (turns[0]) and a suffix")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1, help="passes over the tasks")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--server-log", default=None, help="append the servers' output to this file")


def run(args, doc: dict) -> None:
    from specserve.bench.options import load_prompts

    tasks = load_prompts(args.prompts)
    doc["params"] = {k: v for k, v in vars(args).items() if k != "func"}
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    servers = {}
    try:
        for config in configs:
            servers[config] = _start(config, args)
        for server in servers.values():    # a first request warms each server up
            _infill(server.url, "def f():\n", "\n", 4)
        samples = []
        for rep in range(args.repeats):
            for i, task in enumerate(tasks):
                turn = (i + rep) % len(configs)
                for config in configs[turn:] + configs[:turn]:
                    t = time.perf_counter()
                    answer = _infill(servers[config].url, task.text, task.suffix, args.max_tokens)
                    samples.append({"task": task.question_id, "repeat": rep, "config": config,
                                    "seconds": time.perf_counter() - t, "content": answer["content"],
                                    "tokens": answer["tokens_predicted"],
                                    "draft_n": answer.get("timings", {}).get("draft_n", 0),
                                    "draft_n_accepted": answer.get("timings", {}).get("draft_n_accepted", 0)})
    finally:
        for server in servers.values():
            server.stop()
    doc["table"] = {"columns": COLUMNS, "rows": table_rows(configs, samples)}
    doc["notes"] = [f"{len(tasks)} tasks x {args.repeats}, one request at a time, greedy, at most {args.max_tokens} "
                    f"tokens; {args.model} with {args.draft_model} as the draft; servers on loopback with "
                    f"{args.threads} threads; latency: request to whole answer (prefill included)."]
    doc["samples"] = samples


def table_rows(configs: list[str], samples: list[dict]) -> list[list[str]]:
    by = {c: [s for s in samples if s["config"] == c] for c in configs}
    median = {c: statistics.median(s["seconds"] for s in rows) for c, rows in by.items() if rows}
    answers = {c: {(s["task"], s["repeat"]): s["content"] for s in rows} for c, rows in by.items()}
    peer_draft = next((c for c in configs if c.startswith(PEER + "+")), None)
    out = []
    for c in configs:
        rows = by[c]
        seconds = sorted(s["seconds"] for s in rows)
        drafted = sum(s["draft_n"] for s in rows)
        out.append([
            f"`{c}`", fmt(median[c] * 1000, 0), fmt(seconds[int(0.9 * (len(seconds) - 1))] * 1000, 0),
            fmt(sum(s["tokens"] for s in rows) / sum(seconds)),
            fmt(median[PEER] / median[c], 2, "x") if PEER in median and c != PEER else "—",
            fmt(median[peer_draft] / median[c], 2, "x") if peer_draft in median and c != peer_draft else "—",
            _same(answers.get("plain"), answers[c]), _same(answers.get(PEER), answers[c]),
            fmt(sum(s["draft_n_accepted"] for s in rows) / drafted, 2) if drafted else "—"])
    return out


def _same(reference: dict | None, answers: dict) -> str:
    if reference is None:
        return "—"
    return f"{sum(answers[k] == v for k, v in reference.items())}/{len(reference)}"


def _infill(url: str, prefix: str, suffix: str, n_predict: int) -> dict:
    import httpx

    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": n_predict, "temperature": 0,
            "top_k": 1, "cache_prompt": False}
    r = httpx.post(url + "/infill", json=body, timeout=900)
    r.raise_for_status()
    return r.json()


class _LlamaServer:
    def __init__(self, proc, url: str, log):
        self.proc, self.url, self.log = proc, url, log

    def stop(self) -> None:
        from specserve.bench.peers import stop_process

        stop_process(self.proc)
        self.log.close()


class _SpecserveServer:
    def __init__(self, process):
        self.process, self.url = process, process.url

    def stop(self) -> None:
        self.process.stop()


def _start(config: str, args):
    """A server for ``config``; its ``.url`` and ``.stop()``."""
    from specserve.bench import load_client as lc
    from specserve.bench.peers import gguf_path, start_llama_server

    name, *rest = config.split(":")
    int8 = "int8" in rest                 # specserve with --int8-activations (llama.cpp's arithmetic)
    k = next((r for r in rest if r.isdigit()), "")
    if name.startswith(PEER):
        exe = os.path.join(os.path.expanduser(args.llama_bin), "llama-server")
        if not os.path.isfile(exe):
            raise RuntimeError(f"{exe} not found: build llama.cpp's tools with ../shared/peers/build-llamacpp.sh, or "
                               f"leave {PEER} out of --configs")
        extra = ["-td", str(args.threads)]
        if name == PEER + "+draft":
            extra += ["-md", gguf_path(args.draft_model), "--spec-type", "draft-simple", "--spec-draft-n-max", k or "3"]
        log = open(args.server_log, "a") if args.server_log else open(os.devnull, "w")
        proc, url = start_llama_server(exe, gguf_path(args.model), args.threads, ctx_size=args.max_model_len,
                                       slots=1, log=log, timeout_s=args.startup_timeout, extra_args=extra)
        return _LlamaServer(proc, url, log)
    if name not in ("plain", "draft", "ngram", "suffix"):
        raise ValueError(f"unknown configuration {config!r}: plain, draft:K, ngram:K, suffix:K, {PEER} or "
                         f"{PEER}+draft:K")
    from types import SimpleNamespace

    from specserve.entrypoints.engine_args import NO_SPECULATION_FLAG

    plain = [NO_SPECULATION_FLAG] if NO_SPECULATION_FLAG else []
    if name == "plain":
        extra = list(plain)
    elif name == "draft":
        extra = ["--speculative-model", args.draft_model, "--num-speculative-tokens", k or "4"]
    else:
        extra = ["--speculative-method", name, "--num-speculative-tokens", k or "4"]
    if int8:
        extra.append("--int8-activations")

    process = lc.ServerProcess(extra, SimpleNamespace(model=args.model, max_model_len=args.max_model_len,
                                                      dtype=args.dtype, server_log=args.server_log))
    process.wait_ready(args.startup_timeout)
    return _SpecserveServer(process)

