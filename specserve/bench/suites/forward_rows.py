"""What a model forward costs by its row count: a decode step (1 row) against the verification of
k drafts (k + 1 rows) or of a tree (its nodes + 1), for a target and its draft, in one run.

Speculation trades target steps for extra rows: a chain of k drafts pays when the tokens a step
gains outweigh the cost of k more rows in the target's forward plus k draft forwards. Trees and
beam search with speculation verify more rows still (docs/speculative_decoding.md, "Trees from a
draft model or EAGLE" and "Beam search"), so whether they pay on a machine is read off this
table. Each round times every row count on every model back to back (one warm-up call, then two
timed calls: ``runner.execute`` on one request with ``--context`` cached tokens), so a slow spell
lands on all of them alike; reported: the median milliseconds.

A model may also be ``shape:NAME`` (``bench/random_weights.py``: a published shape such as
llama-3.1-8b with random weights drawn on the device, for GPUs the real weights cannot travel
to); ``shape:NAME:eager`` runs the same with CUDA graphs off. For shapes the table adds the
share of the memory limit (the bytes a decode step streams over ``--memory-bandwidth``), and
with ``--peer transformers`` transformers' ``generate`` per decoded token on the same shape.
"""
from __future__ import annotations

import statistics
import time

from specserve.bench.results import fmt

DEFAULT_MODELS = "qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct"
BLOCK_SIZE = 16


def add_arguments(p) -> None:
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help="comma-separated models (anything `specserve generate --model` accepts; 'default' for "
                        "SmolLM2-135M; NAME+int8: with int8 activations; shape:NAME[:eager] for random weights "
                        "of a published shape: llama-3.1-8b, llama-3.2-1b, qwen2.5-1.5b, smollm2-135m)")
    p.add_argument("--rows", default="1,2,4,5,6,8,13,16", help="comma-separated row counts per forward")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=64, help="tokens already in the KV cache before the timed rows")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--memory-bandwidth", type=float, default=None,
                   help="GB/s the device reads memory at (H200: 4800): adds each shape's share of the memory limit")
    p.add_argument("--chain-steps", type=int, default=0,
                   help="also time K greedy decode steps in a row, as a draft model drafts 2..K+1 (one captured "
                        "graph where the runner has graphs, else K forwards with an argmax each)")
    p.add_argument("--peer", choices=["transformers"], default=None,
                   help="also time transformers' generate per decoded token on each shape (batch 1, greedy)")


def step_input(rows: int, context: int) -> list:
    """One request's ``rows`` new tokens after ``context`` cached ones (16-token blocks)."""
    from specserve.worker.model_runner import ForwardInput

    blocks = list(range((context + rows) // BLOCK_SIZE + 1))
    return [ForwardInput(list(range(100, 100 + rows)), context, blocks, rows)]


def time_forwards(runners: dict, rows_list: list[int], rounds: int, context: int = 64,
                  before=None) -> dict[tuple[str, int], list[float]]:
    """{(runner name, rows): [ms, ...]}: per round, each row count on each runner (a warm-up call,
    then two timed ones); ``before(name)`` runs ahead of each runner's calls."""
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for rows in rows_list:
            inp = step_input(rows, context)
            for name, runner in runners.items():
                if before is not None:
                    before(name)
                runner.execute(inp)
                for _ in range(2):
                    start = time.perf_counter()
                    runner.execute(inp).logits[0, 0].item()   # waits for an accelerator's forward
                    times.setdefault((name, rows), []).append((time.perf_counter() - start) * 1000)
    return times


def time_chain(runner, steps: int, context: int) -> float:
    """ms of ``steps`` greedy decode steps of one request after ``context`` cached tokens, each fed
    the previous argmax: the runner's captured chain where it has one, else forward by forward."""
    from specserve.bench.graph_checks import greedy_steps

    blocks = list(range((context + steps) // BLOCK_SIZE + 1))
    graphs = runner.graphs
    start = time.perf_counter()
    if graphs is not None and graphs.chain_bucket(1, steps):
        graphs.greedy_chain(graphs.chain_bucket(1, steps), [100], [context], [blocks], [steps])
    else:
        greedy_steps(runner, 100, context, blocks, steps)
    return (time.perf_counter() - start) * 1000


def build_runner(model: str, args, max_len: int, rows: int):
    """A model's runner: ``shape:NAME[:eager]`` (random weights, ``bench/random_weights.py``) or
    anything ``LLM(model=...)`` takes ('default': SmolLM2-135M), with ``+int8``: its GGUF blocks
    multiplied with int8 activations."""
    from specserve import LLM
    from specserve.bench import random_weights
    from specserve.engine.start_up import resolve_device
    from specserve.model_executor.loader import resolve_dtype

    if model.startswith("shape:"):
        parts = model.split(":")
        device = resolve_device(args.device)
        return random_weights.random_runner(parts[1], resolve_dtype(args.dtype, device), device, max_len, 1 << 28,
                                            BLOCK_SIZE, enforce_eager="eager" in parts[2:], max_query_len=rows,
                                            max_chain_steps=args.chain_steps)
    name, int8 = model.removesuffix("+int8"), model.endswith("+int8")
    llm = LLM(model=None if name == "default" else name, dtype=args.dtype, device=args.device, max_model_len=max_len,
              kv_cache_memory=1 << 28, int8_activations=int8)
    return llm.engine.runner


def transformers_ms_per_token(shape: str, dtype, device, tokens: int = 64) -> float:
    """transformers' greedy ``generate`` at batch 1 on the shape (random weights): the time of
    ``tokens`` new tokens less that of 1 (the prefill), per token, the median of 3."""
    import torch

    from specserve.bench.random_weights import random_hf_model

    model = random_hf_model(shape, dtype, device)
    ids = torch.arange(100, 164, device=device)[None, :]   # 64 cached tokens, as the suite's context

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)
    per_token = [(timed(tokens) - timed(1)) / (tokens - 1) * 1000 for _ in range(3)]
    return statistics.median(per_token)


def run(args, doc: dict) -> None:
    import torch

    from specserve.bench.random_weights import streamed_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    rows_list = sorted({int(r) for r in args.rows.split(",")})
    if not models or not rows_list or rows_list[0] < 1:
        raise ValueError("--models and --rows need at least one model and row counts >= 1")
    max_len = max(1024, args.context + rows_list[-1] + BLOCK_SIZE)
    runners = {m: build_runner(m, args, max_len, rows_list[-1]) for m in models}
    times = time_forwards(runners, rows_list, args.rounds, args.context)
    if args.chain_steps:
        for _ in range(args.rounds):
            for name, runner in runners.items():
                time_chain(runner, args.chain_steps, args.context)   # warm-up (and capture)
                for _ in range(2):
                    times.setdefault((name, f"chain {args.chain_steps}"), []).append(
                        time_chain(runner, args.chain_steps, args.context))
    medians = {key: statistics.median(v) for key, v in times.items()}
    first = models[0]
    shapes = [m for m in models if m.startswith("shape:")]
    limit_ms = {m: streamed_bytes(runners[m].model) / (args.memory_bandwidth * 1e6)
                for m in shapes if args.memory_bandwidth}
    peer_ms = {}
    if args.peer == "transformers":
        for m in dict.fromkeys(m.split(":")[1] for m in shapes):
            peer_ms[m] = transformers_ms_per_token(m, runners[shapes[0]].dtype, runners[shapes[0]].device)
    table = []
    for m in models:
        one = medians[m, rows_list[0]]
        for r in rows_list:
            ms = medians[m, r]
            extra = (ms - one) / (r - rows_list[0]) if r > rows_list[0] else None
            row = [m, str(r), fmt(ms, 1), f"{ms / one:.2f}x", "—" if extra is None else fmt(extra, 1),
                   f"{ms / medians[first, rows_list[0]]:.2f}x"]
            if limit_ms:
                row.append(f"{limit_ms[m] / ms:.0%}" if m in limit_ms and r == 1 else "—")
            if peer_ms:
                shape = m.split(":")[1] if m in shapes else None
                row.append(f"{fmt(peer_ms[shape], 2)} ({peer_ms[shape] / ms:.2f}x)" if shape and r == 1 else "—")
            table.append(row)
        if args.chain_steps:
            ms = medians[m, f"chain {args.chain_steps}"]
            table.append([m, f"chain {args.chain_steps}", fmt(ms, 1), f"{ms / one:.2f}x", "—",
                          f"{ms / medians[first, rows_list[0]]:.2f}x"] + ["—"] * (bool(limit_ms) + bool(peer_ms)))
    doc["params"] = {"models": models, "rows": rows_list, "rounds": args.rounds, "context": args.context,
                     "dtype": args.dtype, "device": str(runners[models[0]].device),
                     "threads": torch.get_num_threads(), "memory_bandwidth_gbs": args.memory_bandwidth,
                     "peer": args.peer, "chain_steps": args.chain_steps,
                     "graphs": {m: getattr(runners[m], "graphs", None) is not None for m in models}}
    columns = ["model", "rows", "ms", f"vs {rows_list[0]} row(s)", "ms per extra row", f"vs {first}'s decode step"]
    if limit_ms:
        columns.append("of the memory limit")
    if peer_ms:
        columns.append("transformers ms per token (vs this)")
    doc["table"] = {"columns": columns, "rows": table}
    if limit_ms:
        doc["memory_limit_ms"] = limit_ms
    doc["notes"] = [f"One request, {args.context} tokens cached, {args.rounds} rounds x 2 timed calls per row count "
                    "and model, interleaved; median ms of `runner.execute` (the whole forward: layers, attention, "
                    "LM head over every row).",
                    "A chain of k drafts verifies k + 1 rows and runs k draft forwards; a tree of N nodes verifies "
                    "N + 1 rows; beam search with B beams verifies B (k + 1).",
                    "shape:NAME: random weights of that published shape drawn on the device (CUDA graphs on unless "
                    ":eager); of the memory limit: (bytes a decode step streams / --memory-bandwidth) / ms."]
    doc["samples"] = [{"model": m, "rows": r, "ms": times[m, r]} for m in models
                      for r in rows_list + ([f"chain {args.chain_steps}"] if args.chain_steps else [])]
