"""The spec-bench suite (and its presets batch-scaling and gpu): plain decoding and proposers on
the same prompts, interleaved (``bench/runner.py``), as one table per run.

The table has one row per temperature, batch size and configuration over all categories; the
run's whole document (per category and per request) is the results file's ``samples``, and
``--out DIR`` also writes the long report.md, results.json and plots there.
"""
from __future__ import annotations

import os

from specserve.bench.options import ALL
from specserve.bench.results import fmt


def spec_table(run: dict) -> dict:
    """One row per (temperature, batch size, configuration), all categories together."""
    identical = {(x["temperature"], x["batch_size"], x["config"]): f"{x['identical']}/{x['requests']}"
                 for x in run.get("identical_to_plain", [])}
    rows = []
    for r in run["results"]:
        if r["category"] != ALL:
            continue
        sd = r.get("spec_decode") or {}
        up = r.get("speedup_vs_plain")
        rows.append([f"{r['temperature']:g}", str(r["batch_size"]), f"`{r['config']}`", fmt(r["tok_s"]),
                     "—" if r["config"] == "plain" else fmt(up, 2, "x"), fmt(r.get("decode_tok_s")),
                     fmt(sd.get("mean_acceptance_length"), 2), fmt(sd.get("acceptance_rate"), 2),
                     identical.get((r["temperature"], r["batch_size"], r["config"]), "—")])
    return {"columns": ["temperature", "batch", "configuration", "tok/s", "vs plain", "decode tok/s",
                        "tau", "acceptance", "greedy == plain"], "rows": rows}


def spec_notes(run: dict) -> list[str]:
    s = run["settings"]
    return [f"Model {s['model']}, dtype {s['dtype']}; {s['num_prompts']} prompts in {len(run['categories'])} "
            f"categories ({s['prompts']}); {s['max_tokens']} new tokens per request"
            + (" at most" if s["stop_at_eos"] else ", end-of-sequence ignored") + ".",
            "tok/s: new tokens over each group's wall time, prefill included; decode tok/s: after each "
            "request's first token; tau: tokens per target step; configurations interleaved group by group."]


def run(args, doc: dict) -> None:
    from specserve.bench.command import options_from_args
    from specserve.bench.report import render_markdown, write_json
    from specserve.bench.runner import run_bench

    opts = options_from_args(args)
    opts.command = doc["command"]
    run_doc = run_bench(opts)
    doc["machine"], doc["commit"] = run_doc["machine"], run_doc["machine"].get("git", "unknown")
    doc["params"] = {**run_doc["settings"], "configs": run_doc["configs"]}
    doc["table"] = spec_table(run_doc)
    doc["notes"] = spec_notes(run_doc)
    doc["samples"] = run_doc
    if not args.out:
        return
    out = args.out
    os.makedirs(out, exist_ok=True)
    write_json(run_doc, os.path.join(out, "results.json"))
    plots = []
    if not args.no_plots:
        from specserve.bench.plots import write_plots

        plots = write_plots(run_doc, out)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(run_doc, plots))
    print(f"wrote {os.path.join(out, 'report.md')}, results.json" + (", " + ", ".join(plots) if plots else ""))
