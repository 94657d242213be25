"""Draft length chosen per step (``dynamic_k``) against every fixed k and plain decoding, per category.

For each Spec-Bench category (``--questions`` questions each, chat formatted) and each
batch size B (``--batch-sizes``: batches of B requests of that category, its questions
cycled, until each question has run once; with ``--mixed``, batches drawn from every
category in turn, reported as one "mixed" row), every configuration answers the same
requests, greedy, ``--max-tokens`` new tokens with end-of-sequence ignored (so every
configuration does the same work), ``--rounds`` times. Configurations: plain, the
proposer at each fixed k in ``--fixed-ks``, and ``dynamic_k`` with
``num_speculative_tokens = --max-k``.

Interleaving is per batch: each batch of requests is answered by every configuration
back to back, in an order that rotates by batch, round and category, so a slow spell of
the machine lands on all of them alike. Reported per category: median whole-answer
tokens/s over rounds (prompt included); the best fixed k; and **paired ratios**, the
geometric mean over (batch, round) pairs of one configuration's time over another's on
the same batch, with a 90% bootstrap interval (resampling the pairs); and how many decode
steps carried 0, 1, 2, ... drafts.

    python benchmarks/dynamic_k.py --method ngram --fixed-ks 1,2,3,4 --max-k 4 --batch-sizes 1
    python benchmarks/dynamic_k.py --method ngram --fixed-ks "" --max-k 4 --batch-sizes 8,32,64 --mixed --control

``--control`` adds a second plain engine, timed like the others: its ratio to plain shows
how far identical work moves on this machine within the run (the noise floor of a cell).

``--json FILE`` also writes every measurement; ``--report FILE`` prints the tables of
such a file again, without running anything.

The best of several noisy fixed-k figures is biased upwards (the one that got lucky
wins), so each category also gets **dynamic / fixed k chosen on other questions**: the
category's batches are split in two halves (alternating); the best fixed k of one half
(by its paired ratio to plain) is compared with ``dynamic_k`` on the other half, both
ways, and the paired log-ratios are averaged.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import time

from spec_bench import SPEC_BENCH   # benchmarks/spec_bench.py (this script's folder is on sys.path)
CONTROL = "plain (control)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="ngram", choices=["ngram", "suffix", "draft_model", "eagle"])
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--draft-model", default=None, help="draft_model's draft (default: the shipped one)")
    p.add_argument("--fixed-ks", default="1,2,3,4")
    p.add_argument("--max-k", type=int, default=4, help="dynamic_k's maximum")
    p.add_argument("--questions", type=int, default=2, help="questions per category")
    p.add_argument("--categories", default=None, help="comma-separated (default: all)")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", default=SPEC_BENCH)
    p.add_argument("--json", default=None)
    p.add_argument("--control", action="store_true", help="a second plain engine: the noise floor")
    p.add_argument("--mixed", action="store_true", help="batches drawn from all categories (batch > 1)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's")
    p.add_argument("--report", default=None, help="a --json file of an earlier run: print its tables only")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        names = list(dict.fromkeys(r["config"] for r in saved["records"]))
        for batch in sorted({r["batch"] for r in saved["records"]}):
            report([r for r in saved["records"] if r["batch"] == batch], names, saved["args"]["rounds"], args.seed)
        return 0

    import torch

    from specserve import LLM, SamplingParams
    from specserve.bench.options import load_prompts
    torch.set_num_threads(args.threads)

    by_category: dict[str, list[str]] = {}
    for q in load_prompts(args.prompts, args.categories.split(",") if args.categories else None, args.questions):
        by_category.setdefault(q.category, []).append(q.text)
    spec_base = {"method": args.method}
    if args.method == "draft_model" and args.draft_model:
        spec_base["model"] = args.draft_model
    fixed = [int(k) for k in args.fixed_ks.split(",") if k]
    configs = {"plain": None}
    configs.update({f"k={k}": {**spec_base, "num_speculative_tokens": k, "dynamic_k": False} for k in fixed})
    if args.control:
        configs[CONTROL] = None
    configs[f"dynamic k<={args.max_k}"] = {**spec_base, "num_speculative_tokens": args.max_k, "dynamic_k": True}
    engines = {name: LLM(model=args.model, speculative_config=spec, max_model_len=2048, kv_cache_memory=1 << 30,
                         enable_prefix_caching=False)
               for name, spec in configs.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    names = list(engines)
    any_engine = engines["plain"]
    prompts = {c: [any_engine.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
               for c, qs in by_category.items()}
    for llm in engines.values():       # warm-up: kernels, caches, dynamic_k's first figures
        llm.generate(prompts[next(iter(prompts))][:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)

    records = []
    started = time.time()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} method={args.method} fixed k {fixed}, dynamic k<={args.max_k}, "
          f"{args.questions} questions/category, {args.max_tokens} tokens, {args.rounds} rounds, "
          f"threads {args.threads}, load {os.getloadavg()[0]:.1f}", flush=True)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for ci, (category, groups) in enumerate(batches(prompts, batch, args.mixed).items()):
            for rnd in range(args.rounds):
                for gi, requests in enumerate(groups):
                    shift = (rnd + ci + gi) % len(names)
                    reference = None
                    for name in names[shift:] + names[:shift]:
                        llm = engines[name]
                        before = llm.get_spec_decode_stats().as_dict()["steps_by_draft_length"] if configs[name] else []
                        t = time.perf_counter()
                        outs = llm.generate(requests, params, use_tqdm=False)
                        seconds = time.perf_counter() - t
                        tokens = [o.outputs[0].token_ids for o in outs]
                        if name == "plain":
                            reference = tokens
                        after = llm.get_spec_decode_stats().as_dict()["steps_by_draft_length"] if configs[name] else []
                        records.append({"batch": batch, "category": category, "round": rnd, "group": gi,
                                        "config": name, "tokens": sum(len(t) for t in tokens), "seconds": seconds,
                                        "steps_by_draft_length": [a - (before[i] if i < len(before) else 0)
                                                                  for i, a in enumerate(after)],
                                        "answers": tokens})
                    for r in records[-len(names):]:   # plain answered this batch too, in some order
                        r["same_as_plain"] = r.pop("answers") == reference
            print(f"# {category} done after {time.time() - started:.0f} s", flush=True)
            if args.json:   # after every category: a long run that stops still leaves its figures
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "records": records}, f, indent=1)
        print(f"# batch {batch} done after {time.time() - started:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        report([r for r in records if r["batch"] == batch], names, args.rounds, args.seed)
    return 0


def batches(prompts: dict[str, list[str]], batch: int, mixed: bool) -> dict[str, list[list[str]]]:
    """Per category, batches of ``batch`` requests, its questions cycled until each ran once;
    ``mixed``: one "mixed" entry whose batches take every category's questions in turn."""
    if mixed:
        pool = [q for qs in itertools.zip_longest(*prompts.values()) for q in qs if q is not None]
        prompts = {"mixed": pool}
    return {c: [[ids[(g * batch + i) % len(ids)] for i in range(batch)] for g in range(max(1, -(-len(ids) // batch)))]
            for c, ids in prompts.items()}


def log_ratios(records: list[dict], a: str, b: str, groups=None) -> list[float]:
    """log(b's time / a's time) for every batch (category, round, group) both answered, only
    those of ``groups`` if given."""
    seconds = {(r["category"], r["round"], r["group"], r["config"]): r["seconds"] for r in records}
    return [math.log(seconds[key[:3] + (b,)] / t) for key, t in seconds.items()
            if key[3] == a and key[:3] + (b,) in seconds and (groups is None or key[2] in groups)]


def paired(records: list[dict], a: str, b: str, rng: random.Random, draws: int = 2000) -> tuple[float, float, float]:
    """Geometric mean over (round, group) pairs of b's time over a's on the same batch (above 1:
    a is faster), and its 90% bootstrap interval."""
    logs = log_ratios(records, a, b)
    if not logs:
        return float("nan"), float("nan"), float("nan")
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(draws))
    return (math.exp(statistics.fmean(logs)), math.exp(means[int(0.05 * draws)]), math.exp(means[int(0.95 * draws) - 1]))


def cross_validated(records: list[dict], dynamic: str, fixed: list[str]) -> float:
    """dynamic_k against the fixed k that was best on the other half of the batches (see the
    module docstring): the geometric mean of the paired ratios, above 1 when dynamic_k is faster."""
    groups = sorted({r["group"] for r in records})
    halves = [groups[0::2], groups[1::2]]
    if not fixed or not all(halves):
        return float("nan")
    logs = []
    for pick, test in ((halves[0], halves[1]), (halves[1], halves[0])):
        best = max(fixed, key=lambda n: statistics.fmean(log_ratios(records, n, "plain", pick)))
        logs += log_ratios(records, dynamic, best, test)
    return math.exp(statistics.fmean(logs))


def report(records: list[dict], names: list[str], rounds: int, seed: int = 0) -> None:
    dynamic = names[-1]
    fixed = [n for n in names[1:-1] if n != CONTROL]
    control = [CONTROL] if CONTROL in names else []
    rng = random.Random(seed)
    mismatches = [r for r in records if r["same_as_plain"] is False]

    def ratio(records, a, b) -> str:
        mid, lo, hi = paired(records, a, b, rng)
        return f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"

    for batch in sorted({r["batch"] for r in records}):
        mine = [r for r in records if r["batch"] == batch]
        print(f"\n## batch {batch}\n")
        print("| category | plain | " + "".join(f"{n} | " for n in fixed) + f"{dynamic} | best fixed | dynamic / best fixed "
              "| dynamic / fixed k chosen on other questions | dynamic / plain | "
              + "".join(f"{n} / plain | " for n in control) + "dynamic's steps by drafts |")
        print("|---|" + "---|" * (len(fixed) + len(control) + 7))
        worst_best, worst_cv, worst_plain, totals = [], [], [], {n: [0, 0.0] for n in names}
        for category in dict.fromkeys(r["category"] for r in mine):
            cell = [r for r in mine if r["category"] == category]
            rate, steps = {}, []
            for name in names:
                rs = [r for r in cell if r["config"] == name]
                per_round = [sum(r["tokens"] for r in rs if r["round"] == k) / sum(r["seconds"] for r in rs if r["round"] == k)
                             for k in sorted({r["round"] for r in rs})]
                rate[name] = statistics.median(per_round)
                totals[name][0] += sum(r["tokens"] for r in rs)
                totals[name][1] += sum(r["seconds"] for r in rs)
                if name == dynamic:
                    steps = [sum(col) for col in itertools.zip_longest(*[r["steps_by_draft_length"] for r in rs], fillvalue=0)]
            # the best fixed k by its paired ratio to plain (else plain itself)
            best = max(fixed, key=lambda n: paired(cell, n, "plain", rng, 1)[0]) if fixed else "plain"
            vs_best, vs_plain = paired(cell, dynamic, best, rng), paired(cell, dynamic, "plain", rng)
            worst_best.append(vs_best[0])
            cv = cross_validated(cell, dynamic, fixed)
            worst_cv.append(cv)
            worst_plain.append(vs_plain[0])
            controls = "".join(f"{ratio(cell, n, 'plain')} | " for n in control)
            print(f"| {category} | {rate['plain']:.1f} | " + "".join(f"{rate[n]:.1f} | " for n in fixed)
                  + f"{rate[dynamic]:.1f} | {best} | {vs_best[0]:.2f}x ({vs_best[1]:.2f}-{vs_best[2]:.2f}) "
                  f"| {cv:.3f}x | {vs_plain[0]:.2f}x ({vs_plain[1]:.2f}-{vs_plain[2]:.2f}) | {controls}{steps} |")
        whole = {n: t / s for n, (t, s) in totals.items()}
        controls = "".join(f"{ratio(mine, n, 'plain')} | " for n in control)
        print(f"| **all** | {whole['plain']:.1f} | " + "".join(f"{whole[n]:.1f} | " for n in fixed)
              + f"{whole[dynamic]:.1f} | | min {min(worst_best):.2f}x | min {min(worst_cv):.3f}x "
              f"| {ratio(mine, dynamic, 'plain')}, "
              f"min {min(worst_plain):.2f}x | {controls}|")
    print(f"\n{rounds} rounds per cell; ratios: geometric mean of paired times (90% bootstrap interval); "
          f"greedy outputs differing from plain: {len(mismatches)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
