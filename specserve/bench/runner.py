"""What ``specserve bench`` runs: every configuration on the same prompts, interleaved.

Work is cut into *units*: one temperature, one batch size, one category, one group
of exactly ``batch_size`` prompts of that category (a category with fewer prompts
is cycled to fill its groups, so every group measures B requests in flight). Each
unit runs every configuration, the configurations in an order rotated by one per
unit, so a noisy machine slows all of them alike. tok/s is new tokens over the
wall time of the group's ``generate`` call (prefill included, as Spec-Bench
measures); "decode tok/s" counts the tokens after each request's first over the
time after the group's last first token (specserve configurations only).

This module runs the units and tallies them into the results document; what it
runs comes from ``options.py`` (prompts, configurations, BenchOptions),
``engines.py`` (specserve) and ``peers.py`` (transformers, llama.cpp), the
machine facts from ``machine.py``.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from collections import OrderedDict

import torch

from specserve.bench.engines import GroupResult, SpecserveEngine
from specserve.bench.machine import machine_facts, memory_available, process_memory
from specserve.bench.options import (
    ALL,
    METHODS,
    BenchOptions,
    BenchPrompt,
    Config,
    default_prompts_path,
    load_prompts,
    parse_configs,
    parse_list,
)
from specserve.entrypoints.fill_in_middle import fim_prompt, fim_tokens

# What tests and peers imported from this module before it was split stays importable here.
__all__ = ["ALL", "METHODS", "BenchOptions", "BenchPrompt", "Config", "GroupResult", "SpecserveEngine", "Tally",
           "build_engines", "default_prompts_path", "groups_of", "identical_to_plain", "load_prompts",
           "machine_facts", "parse_configs", "parse_list", "run_bench"]


# --------------------------------------------------------------------------- tallies
class Tally:
    def __init__(self):
        from specserve.outputs import SpecDecodeStats

        self.requests = 0
        self.tokens = 0
        self.seconds = 0.0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.has_decode = False
        self.spec = SpecDecodeStats()
        self.has_spec = False

    def row(self) -> dict:
        d = {"requests": self.requests, "tokens": self.tokens, "seconds": round(self.seconds, 6),
             "tok_s": round(self.tokens / self.seconds, 3) if self.seconds else None,
             "decode_tok_s": (round(self.decode_tokens / self.decode_seconds, 3)
                              if self.has_decode and self.decode_seconds > 0 else None),
             "spec_decode": None}
        if self.has_spec:
            d["spec_decode"] = self.spec.as_dict()
            d["spec_decode"]["accepted_per_position"] = list(self.spec.accepted_per_position)
            d["spec_decode"]["drafted_per_position"] = list(self.spec.drafted_per_position)
        return d


def groups_of(prompts: list[BenchPrompt], batch_size: int) -> list[list[BenchPrompt]]:
    """Groups of exactly ``batch_size`` prompts; the last one wraps around to the first prompts."""
    n = -(-len(prompts) // batch_size) * batch_size
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    return [cycled[i:i + batch_size] for i in range(0, n, batch_size)]


# --------------------------------------------------------------------------- the run
def build_engines(opts: BenchOptions) -> list:
    engines: list = []
    try:
        for i, config in enumerate(opts.configs):
            before = process_memory()
            engines.append(SpecserveEngine(config, opts))
            check_room_for(opts.configs[i + 1:], config.name, before, process_memory(), memory_available())
    except BaseException:
        for e in engines:
            e.close()
        raise
    for peer in opts.peers:
        from specserve.bench import peers

        if peer == "transformers":   # one peer per dtype of --transformers-dtype (comma-separated)
            dtypes = list(dict.fromkeys(d.strip() for d in opts.transformers_dtype.split(",") if d.strip()))
            engines += [peers.TransformersPeer(opts, d, named_by_dtype=len(dtypes) > 1) for d in dtypes]
        elif peer == "transformers-assisted":
            engines.append(peers.TransformersPeer(opts, assistant=opts.draft_model or peers.shipped_draft_for(opts)))
        elif peer == "transformers-ngram":
            engines.append(peers.TransformersPeer(opts, prompt_lookup=peers.PROMPT_LOOKUP_TOKENS))
        elif peer == "llama.cpp":
            engines.append(peers.LlamaCppPeer(opts))
        else:
            raise ValueError(f"unknown peer {peer!r}: use transformers, transformers-assisted, transformers-ngram "
                             "or llama.cpp")
    names = [e.name for e in engines]
    if len(set(names)) < len(names):
        for e in engines:
            e.close()
        raise ValueError(f"two configurations of the same name in {names} (e.g. --transformers-dtype bf16,bfloat16)")
    return engines


def check_room_for(rest: list[Config], name: str, before: int | None, after: int | None,
                   available: int | None) -> None:
    """Stop, with a message that says what to do, before the next engines run the machine out of memory.

    Configurations are interleaved prompt group by prompt group, so every one of them holds its own
    engine (its target, its draft, its KV cache) for the whole run: ten configurations of a 1.5B
    target and its draft take about 30 GiB. The engine just built (``before`` -> ``after`` bytes
    of this process) stands for each of the ``rest``; where the memory still ``available`` cannot
    hold them, the run stops now rather than being killed half-way. Unknown sizes (no /proc) skip
    the check."""
    if not rest or before is None or after is None or available is None or after <= before:
        return
    each = after - before
    if each * len(rest) > available:
        gib = 1 << 30
        raise MemoryError(
            f"not enough memory for {len(rest)} more bench configurations: {name!r} took {each / gib:.1f} GiB, so "
            f"{', '.join(c.name for c in rest)} would need about {each * len(rest) / gib:.1f} GiB and "
            f"{available / gib:.1f} GiB is available. Every configuration keeps its engine loaded for the whole run "
            "(they are interleaved); run fewer configurations at once (--configs) or give each less KV cache "
            "(--kv-cache-memory)")


def run_bench(opts: BenchOptions) -> dict:
    """Run everything; returns the results document (what results.json holds)."""
    from specserve.outputs import SpecDecodeStats  # noqa: F401  (fail early if the package is broken)

    if opts.threads:
        torch.set_num_threads(opts.threads)
    prompts = load_prompts(opts.prompts_path, opts.categories, opts.limit)
    started = datetime.datetime.now(datetime.timezone.utc)
    machine = machine_facts()
    engines = build_engines(opts)
    try:
        return _run(opts, prompts, engines, machine, started)
    finally:
        for e in engines:
            e.close()


def prompt_token_ids(tok, text: str) -> list[int]:
    """A question as the model's chat template renders it; a model without one (a base model such
    as Gemma 3 270M) gets the question as a plain-text completion, with its tokenizer's BOS."""
    if not getattr(tok, "chat_template", None):
        return tok.encode(text, add_special_tokens=True)
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def _run(opts: BenchOptions, prompts: list[BenchPrompt], engines: list, machine: dict, started) -> dict:
    tok = engines[0].tokenizer()
    for p in prompts:
        if p.suffix is not None:   # fill in the middle, ended by the model's end-of-middle tokens
            p.token_ids = fim_prompt(tok, p.text, p.suffix)
            p.stop_token_ids = list(fim_tokens(tok).ends)
        else:
            p.token_ids = prompt_token_ids(tok, p.text)
    categories = list(OrderedDict.fromkeys(p.category for p in prompts))
    by_cat = {c: [p for p in prompts if p.category == c] for c in categories}
    names = [e.name for e in engines]
    ignore_eos = not opts.stop_at_eos

    units = []   # (temperature, batch size, category, group index, prompts)
    for t in opts.temperatures:
        for bs in opts.batch_sizes:
            for c in categories:
                for gi, g in enumerate(groups_of(by_cat[c], bs)):
                    units.append((t, bs, c, gi, g))

    tallies: dict[tuple, Tally] = {}

    def tally(*key) -> Tally:
        if key not in tallies:
            tallies[key] = Tally()
        return tallies[key]

    per_request = []
    bar = _progress(len(units) * len(engines), opts.progress)
    warmed = set()
    t_start = time.perf_counter()
    try:
        for ui, (t, bs, cat, gi, group) in enumerate(units):
            if (t, bs) not in warmed:   # one short untimed run per engine at each batch size and temperature
                for e in engines:
                    bar.set_postfix_str(f"warm-up {e.name} batch {bs}", refresh=True)
                    e.run(group, min(8, opts.max_tokens), t, [opts.seed + i for i in range(len(group))], ignore_eos)
                warmed.add((t, bs))
            r = ui % len(engines)
            order = engines[r:] + engines[:r]
            seeds = [opts.seed + 1000 * ui + i for i in range(len(group))]
            for e in order:
                bar.set_postfix_str(f"T={t:g} batch {bs} {cat} {e.name}", refresh=False)
                t0 = time.perf_counter()
                res = e.run(group, opts.max_tokens, t, seeds, ignore_eos)
                dt = time.perf_counter() - t0
                ntok = sum(len(x) for x in res.token_ids)
                for c in (cat, ALL):
                    tl = tally(t, bs, c, e.name)
                    tl.requests += len(group)
                    tl.tokens += ntok
                    tl.seconds += dt
                    if res.decode_seconds is not None:
                        tl.has_decode = True
                        tl.decode_tokens += sum(max(len(x) - 1, 0) for x in res.token_ids)
                        tl.decode_seconds += res.decode_seconds
                    for st in res.spec_stats:
                        if st is not None and getattr(st, "num_drafts", 0) + getattr(st, "num_steps", 0) > 0 \
                                and e.name != "plain" and isinstance(e, SpecserveEngine):
                            tl.spec.merge(st)
                            tl.has_spec = True
                for row, (p, ids) in enumerate(zip(group, res.token_ids)):
                    st = res.spec_stats[row]
                    per_request.append({"temperature": t, "batch_size": bs, "category": cat, "unit": ui,
                                        "row": row, "config": e.name, "question_id": p.question_id,
                                        "prompt_tokens": len(p.token_ids), "num_tokens": len(ids),
                                        "group_seconds": round(dt, 6),
                                        "spec_decode": st.as_dict() if st is not None and e.name != "plain" else None,
                                        "token_ids": ids})
                bar.update(1)
    finally:
        bar.close()
    elapsed = time.perf_counter() - t_start
    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    results = []
    for (t, bs, c, name), tl in tallies.items():
        results.append({"temperature": t, "batch_size": bs, "category": c, "config": name, **tl.row()})
    order_cat = {c: i for i, c in enumerate(categories + [ALL])}
    order_name = {n: i for i, n in enumerate(names)}
    results.sort(key=lambda r: (opts.temperatures.index(r["temperature"]), opts.batch_sizes.index(r["batch_size"]),
                                order_cat[r["category"]], order_name[r["config"]]))
    plain_rows = {(r["temperature"], r["batch_size"], r["category"]): r for r in results if r["config"] == "plain"}
    for r in results:
        plain = plain_rows.get((r["temperature"], r["batch_size"], r["category"]), {})
        for rate, speedup in (("tok_s", "speedup_vs_plain"), ("decode_tok_s", "decode_speedup_vs_plain")):
            base = plain.get(rate)
            r[speedup] = round(r[rate] / base, 4) if base and r[rate] else None

    return {
        "schema": "specserve-bench/1",
        "command": opts.command,
        "date": started.isoformat(timespec="seconds"),
        "elapsed_seconds": round(elapsed, 1),
        "machine": machine,
        "settings": {
            "model": opts.model or "default (SmolLM2-135M-Instruct)", "dtype": opts.dtype, "device": opts.device,
            "prompts": opts.prompts_path or "shipped default (specserve/bench/prompts.jsonl)",
            "num_prompts": len(prompts), "limit_per_category": opts.limit, "categories": categories,
            "batch_sizes": opts.batch_sizes, "temperatures": opts.temperatures, "max_tokens": opts.max_tokens,
            "stop_at_eos": opts.stop_at_eos, "max_model_len": opts.max_model_len, "seed": opts.seed,
            "threads": torch.get_num_threads(), "prefix_caching": False,
            "transformers_dtype": opts.transformers_dtype if any(p.startswith("transformers") for p in opts.peers) else None,
        },
        "configs": [{"name": e.name, "kind": "specserve" if isinstance(e, SpecserveEngine) else "peer",
                     "speculative_config": getattr(e, "resolved", None), "description": getattr(e, "description", None)}
                    for e in engines],
        "categories": categories,
        "results": results,
        "identical_to_plain": identical_to_plain(per_request, names),
        "per_request": per_request,
    }


def identical_to_plain(per_request: list[dict], names: list[str]) -> list[dict]:
    """Greedy runs only: how many answers of each configuration equal plain decoding's, token for token."""
    plain = {(r["temperature"], r["batch_size"], r["unit"], r["row"]): r["token_ids"]
             for r in per_request if r["config"] == "plain" and r["temperature"] == 0}
    out: dict[tuple, list[int]] = {}
    for r in per_request:
        if r["config"] == "plain" or r["temperature"] != 0:
            continue
        key = (r["batch_size"], r["config"])
        same = out.setdefault(key, [0, 0])
        same[1] += 1
        same[0] += r["token_ids"] == plain.get((r["temperature"], r["batch_size"], r["unit"], r["row"]))
    return [{"temperature": 0.0, "batch_size": bs, "config": n, "identical": s[0], "requests": s[1]}
            for (bs, n), s in sorted(out.items(), key=lambda kv: (kv[0][0], names.index(kv[0][1])))]


class _NoBar:
    def set_postfix_str(self, *a, **k):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="run", desc="bench", file=sys.stderr, dynamic_ncols=True)
