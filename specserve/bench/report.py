"""results.json and report.md from the results document ``runner.run_bench`` returns."""
from __future__ import annotations

import json
import os

from specserve.bench.options import ALL
from specserve.config import SpeculativeConfig


def write_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _fmt(x, digits: int = 1, suffix: str = "") -> str:
    return "—" if x is None else f"{x:.{digits}f}{suffix}"


def _index(doc: dict) -> dict:
    return {(r["temperature"], r["batch_size"], r["category"], r["config"]): r for r in doc["results"]}


def spec_configs(doc: dict) -> list[str]:
    """Configurations that speculate (they have acceptance figures)."""
    return [c["name"] for c in doc["configs"] if c["kind"] == "specserve" and c["name"] != "plain"]


def aggregate_by_position(doc: dict, config: str, temperature: float) -> list[float]:
    """Acceptance rate per draft position over every batch size and category."""
    acc, drafted = [], []
    for r in doc["results"]:
        sd = r.get("spec_decode")
        if r["config"] != config or r["temperature"] != temperature or r["category"] != ALL or not sd:
            continue
        for lst, src in ((acc, sd["accepted_per_position"]), (drafted, sd["drafted_per_position"])):
            lst.extend([0] * (len(src) - len(lst)))
            for i, v in enumerate(src):
                lst[i] += v
    return [a / d if d else 0.0 for a, d in zip(acc, drafted)]


def render_markdown(doc: dict, plots: list[str] | None = None) -> str:
    idx = _index(doc)
    s, m = doc["settings"], doc["machine"]
    names = [c["name"] for c in doc["configs"]]
    others = [n for n in names if n != "plain"]
    specs = spec_configs(doc)
    cats = doc["categories"] + [ALL]
    L = ["# specserve bench", ""]
    L += ["Command:", "", "```", doc["command"], "```", ""]
    v = m["versions"]
    L += [f"- Date: {doc['date']} (took {doc['elapsed_seconds']:.0f} s), code {m.get('git', 'unknown')}",
          f"- Machine: {m['cpu']}, {m['cpu_count']} CPUs, torch threads {m['torch_threads']}, "
          f"CPU capability {m['cpu_capability']}" + (f", GPU {m['cuda']}" if m.get("cuda") else "")
          + (f", load average {m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end"
             if m.get("loadavg_start") and m.get("loadavg_end") else ""),
          f"- Versions: python {v['python']}, torch {v['torch']}, specserve {v['specserve']}"
          + (f", transformers {v['transformers']}" if "transformers" in v else ""),
          f"- Model: {s['model']}, dtype {s['dtype']}; prompts: {s['prompts']}, {s['num_prompts']} prompts "
          f"in {len(doc['categories'])} categories"
          + (f" (at most {s['limit_per_category']} per category)" if s["limit_per_category"] else ""),
          f"- {s['max_tokens']} new tokens per request"
          + (" at most (answers end at end-of-sequence)" if s["stop_at_eos"] else " (end-of-sequence ignored, so "
             "every configuration does the same work)")
          + f"; batch sizes {', '.join(map(str, s['batch_sizes']))}; temperatures "
          + ", ".join(f"{t:g}" for t in s["temperatures"]) + "; prefix caching off for all",
          "- Configurations: " + "; ".join(
              f"`{c['name']}`" + (f" ({_spec_text(c['speculative_config'])})" if c.get("speculative_config") else "")
              + (f" ({c['description']})" if c.get("description") else "") for c in doc["configs"]),
          "",
          "tok/s: new tokens over the wall time of each group's generate call, prefill included; "
          "configurations interleaved group by group in rotating order. Speedup: tok/s over plain decoding's "
          "in the same cell. Mean acceptance length (tau): tokens emitted per verification step (plain = 1). "
          "Decode tok/s (specserve configurations): the tokens after each request's first over the time after "
          "its group's last first token, so prefill does not dilute speculation's effect; decode speedup: over "
          "plain decoding's.",
          ""]

    for t in s["temperatures"]:
        for bs in s["batch_sizes"]:
            L += [f"## Temperature {t:g}, batch size {bs}", ""]
            head = ["category"] + [f"{n} tok/s" for n in names] + [f"{n} speedup" for n in others] \
                + [f"{n} tau" for n in specs] + [f"{n} decode speedup" for n in specs]
            L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for c in cats:
                rows = [idx.get((t, bs, c, n)) for n in names]
                if not any(rows):
                    continue
                cells = [f"**{c}**" if c == ALL else c]
                cells += [_fmt(r and r["tok_s"]) for r in rows]
                cells += [_fmt((idx.get((t, bs, c, n)) or {}).get("speedup_vs_plain"), 2, "x") for n in others]
                cells += [_fmt(((idx.get((t, bs, c, n)) or {}).get("spec_decode") or {}).get("mean_acceptance_length"),
                               2) for n in specs]
                cells += [_fmt((idx.get((t, bs, c, n)) or {}).get("decode_speedup_vs_plain"), 2, "x") for n in specs]
                L.append("| " + " | ".join(cells) + " |")
            same = [x for x in doc.get("identical_to_plain", []) if x["temperature"] == t and x["batch_size"] == bs]
            if same:
                L += ["", "Greedy answers identical to plain decoding, token for token: " + ", ".join(
                    f"{x['config']} {x['identical']}/{x['requests']}" for x in same)]
            L.append("")

    decoders = [c["name"] for c in doc["configs"] if c["kind"] == "specserve"]
    if any(r.get("decode_tok_s") for r in doc["results"]):
        L += ["## Decode tok/s, prefill excluded (all categories)", ""]
        head = ["configuration", "temperature"] + [f"batch {b}" for b in s["batch_sizes"]]
        L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in decoders:
            for t in s["temperatures"]:
                cells = []
                for b in s["batch_sizes"]:
                    r = idx.get((t, b, ALL, n)) or {}
                    up = r.get("decode_speedup_vs_plain") if n != "plain" else None
                    cells.append(_fmt(r.get("decode_tok_s")) + (f" ({up:.2f}x)" if up else ""))
                L.append("| " + " | ".join([n, f"{t:g}"] + cells) + " |")
        L.append("")

    if specs:
        L += ["## Acceptance by draft position", "",
              "Share of drafted tokens accepted at each position after the last verified token "
              "(all categories and batch sizes).", ""]
        width = max((len(aggregate_by_position(doc, n, t)) for n in specs for t in s["temperatures"]), default=0)
        head = ["configuration", "temperature", "acceptance rate", "tau"] + [f"pos {i + 1}" for i in range(width)]
        L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in specs:
            for t in s["temperatures"]:
                pos = aggregate_by_position(doc, n, t)
                tot = _spec_total(doc, n, t)
                L.append("| " + " | ".join([n, f"{t:g}", _fmt(tot[0], 3), _fmt(tot[1], 2)]
                                           + [f"{p:.2f}" for p in pos] + ["—"] * (width - len(pos))) + " |")
        L.append("")

    if len(s["batch_sizes"]) > 1:
        L += ["## tok/s against batch size (all categories)", ""]
        head = ["configuration", "temperature"] + [f"batch {b}" for b in s["batch_sizes"]]
        L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in names:
            for t in s["temperatures"]:
                L.append("| " + " | ".join([n, f"{t:g}"] + [_fmt((idx.get((t, b, ALL, n)) or {}).get("tok_s"))
                                                             for b in s["batch_sizes"]]) + " |")
        L.append("")

    if plots:
        L += ["## Plots", ""]
        L += [f"![{os.path.splitext(p)[0]}]({p})" for p in plots]
        L.append("")
    L += ["Raw numbers, per request included: `results.json`.", ""]
    return "\n".join(L)


def _spec_total(doc: dict, config: str, temperature: float) -> tuple[float | None, float | None]:
    acc = drafted = emitted = steps = 0
    for r in doc["results"]:
        sd = r.get("spec_decode")
        if r["config"] == config and r["temperature"] == temperature and r["category"] == ALL and sd:
            acc += sd["num_accepted_tokens"]
            drafted += sd["num_draft_tokens"]
            emitted += sd["num_emitted_tokens"]
            steps += sd["num_steps"]
    return (acc / drafted if drafted else None, emitted / steps if steps else None)


def _spec_text(spec: dict) -> str:
    keys = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")
    ngram = spec.get("method") == "ngram"
    text = [f"{k}={spec[k]}" for k in keys
            if k in spec and (k != "model" or not ngram) and (ngram or not k.startswith("prompt_lookup"))]
    flags = {"prompt_lookup_tree": True, "prompt_lookup_adaptive": False, "dynamic_k": True}
    text += [f"{k}={v}" for k, v in flags.items() if spec.get(k) is v and (ngram or not k.startswith("prompt_lookup"))]
    if spec.get("method") in SpeculativeConfig.DYNAMIC_K_BY_DEFAULT and spec.get("dynamic_k") is False:   # say when off
        text.append("dynamic_k=False")
    if spec.get("disable_by_batch_size") is not None:
        text.append(f"disable_by_batch_size={spec['disable_by_batch_size']}")
    return ", ".join(text)
