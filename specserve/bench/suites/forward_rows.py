"""What a model forward costs by its row count: a decode step (1 row) against the verification of
k drafts (k + 1 rows) or of a tree (its nodes + 1), for a target and its draft, in one run.

Speculation trades target steps for extra rows: a chain of k drafts pays when the tokens a step
gains outweigh the cost of k more rows in the target's forward plus k draft forwards. Trees and
beam search with speculation verify more rows still (docs/speculative_decoding.md, "Trees from a
draft model or EAGLE" and "Beam search"), so whether they pay on a machine is read off this
table. Each round times every row count on every model back to back (one warm-up call, then two
timed calls: ``LLMEngine.runner.execute`` on one request with ``--context`` cached tokens), so a
slow spell lands on all of them alike; reported: the median milliseconds.
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
                        "SmolLM2-135M)")
    p.add_argument("--rows", default="1,2,4,5,6,8,13,16", help="comma-separated row counts per forward")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=64, help="tokens already in the KV cache before the timed rows")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def step_input(rows: int, context: int) -> list:
    """One request's ``rows`` new tokens after ``context`` cached ones (16-token blocks)."""
    from specserve.worker.model_runner import ForwardInput

    blocks = list(range((context + rows) // BLOCK_SIZE + 1))
    return [ForwardInput(list(range(100, 100 + rows)), context, blocks, rows)]


def time_forwards(llms: dict, rows_list: list[int], rounds: int, context: int = 64,
                  before=None) -> dict[tuple[str, int], list[float]]:
    """{(engine name, rows): [ms, ...]}: per round, each row count on each engine (a warm-up call,
    then two timed ones); ``before(name)`` runs ahead of each engine's calls."""
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for rows in rows_list:
            inp = step_input(rows, context)
            for name, llm in llms.items():
                if before is not None:
                    before(name)
                llm.engine.runner.execute(inp)
                for _ in range(2):
                    start = time.perf_counter()
                    llm.engine.runner.execute(inp).logits[0, 0].item()   # waits for an accelerator's forward
                    times.setdefault((name, rows), []).append((time.perf_counter() - start) * 1000)
    return times


def run(args, doc: dict) -> None:
    import torch

    from specserve import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    rows_list = sorted({int(r) for r in args.rows.split(",")})
    if not models or not rows_list or rows_list[0] < 1:
        raise ValueError("--models and --rows need at least one model and row counts >= 1")
    max_len = max(1024, args.context + rows_list[-1] + BLOCK_SIZE)
    llms = {m: LLM(model=None if m == "default" else m, dtype=args.dtype, device=args.device, max_model_len=max_len,
                   kv_cache_memory=1 << 28) for m in models}
    times = time_forwards(llms, rows_list, args.rounds, args.context)
    medians = {key: statistics.median(v) for key, v in times.items()}
    first = models[0]
    table = []
    for m in models:
        one = medians[m, rows_list[0]]
        for r in rows_list:
            ms = medians[m, r]
            extra = (ms - one) / (r - rows_list[0]) if r > rows_list[0] else None
            table.append([m, str(r), fmt(ms, 1), f"{ms / one:.2f}x", "—" if extra is None else fmt(extra, 1),
                          f"{ms / medians[first, rows_list[0]]:.2f}x"])
    doc["params"] = {"models": models, "rows": rows_list, "rounds": args.rounds, "context": args.context,
                     "dtype": args.dtype, "device": str(llms[models[0]].engine.runner.device),
                     "threads": torch.get_num_threads()}
    doc["table"] = {"columns": ["model", "rows", "ms", f"vs {rows_list[0]} row(s)", "ms per extra row",
                                f"vs {first}'s decode step"], "rows": table}
    doc["notes"] = [f"One request, {args.context} tokens cached, {args.rounds} rounds x 2 timed calls per row count "
                    "and model, interleaved; median ms of `runner.execute` (the whole forward: layers, attention, "
                    "LM head over every row).",
                    "A chain of k drafts verifies k + 1 rows and runs k draft forwards; a tree of N nodes verifies "
                    "N + 1 rows; beam search with B beams verifies B (k + 1)."]
    doc["samples"] = [{"model": m, "rows": r, "ms": times[m, r]} for m in models for r in rows_list]
