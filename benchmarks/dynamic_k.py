"""Draft length chosen per step (``dynamic_k``) against every fixed k and plain decoding, per category.

For each Spec-Bench category (``--questions`` questions each, chat formatted) and each
batch size B (``--batch-sizes``: batches of B requests of that category, its questions
cycled, until each question has run once), every
configuration answers the same requests, greedy, ``--max-tokens`` new tokens with
end-of-sequence ignored (so every configuration does the same work), ``--rounds`` times;
the configurations take turns in an order that rotates by round and category. A cell's
figure is the median over rounds of whole-answer tokens/s (prompt included). Configurations:
plain, the proposer at each fixed k in ``--fixed-ks``, and ``dynamic_k`` with
``num_speculative_tokens = --max-k``. Reported per category: the best fixed k, dynamic
against it and against plain, and how many decode steps carried 0, 1, 2, ... drafts.

    python benchmarks/dynamic_k.py --method ngram --fixed-ks 1,2,3,4 --max-k 4 --batch-sizes 1
    python benchmarks/dynamic_k.py --method ngram --fixed-ks 4 --max-k 4 --batch-sizes 8,32,64 --max-tokens 48

``--control`` adds a second plain engine, timed like the others: its ratio to plain shows
how far identical work moves on this machine within the run (the noise floor of a cell).

``--json FILE`` also writes every measurement.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC_BENCH = os.path.join(HERE, "..", "..", "shared", "data", "spec_bench", "question.jsonl")
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
    args = p.parse_args()

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
        for ci, (category, ids) in enumerate(prompts.items()):
            # Batches of B requests, the category's questions cycled, until each question ran once.
            groups = [[ids[(g * batch + i) % len(ids)] for i in range(batch)]
                      for g in range(max(1, -(-len(ids) // batch)))]
            reference = None
            for rnd in range(args.rounds):
                shift = (rnd + ci) % len(names)
                for name in names[shift:] + names[:shift]:
                    llm = engines[name]
                    before = llm.get_spec_decode_stats().as_dict()["steps_by_draft_length"] if configs[name] else []
                    t = time.perf_counter()
                    outs = [o for requests in groups for o in llm.generate(requests, params, use_tqdm=False)]
                    seconds = time.perf_counter() - t
                    tokens = [o.outputs[0].token_ids for o in outs]
                    if name == "plain":
                        reference = reference or tokens
                    after = llm.get_spec_decode_stats().as_dict()["steps_by_draft_length"] if configs[name] else []
                    records.append({"batch": batch, "category": category, "round": rnd, "config": name,
                                    "tokens": sum(len(t) for t in tokens), "seconds": seconds,
                                    "steps_by_draft_length": [a - (before[i] if i < len(before) else 0)
                                                              for i, a in enumerate(after)],
                                    "same_as_plain": None if reference is None else tokens == reference})
        print(f"# batch {batch} done after {time.time() - started:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        if args.json:   # after every batch size: a long run that stops still leaves its figures
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "records": records}, f, indent=1)
        report([r for r in records if r["batch"] == batch], names, args.rounds)
    return 0


def report(records: list[dict], names: list[str], rounds: int) -> None:
    dynamic = names[-1]
    fixed = [n for n in names[1:-1] if n != CONTROL]
    control = [CONTROL] if CONTROL in names else []
    mismatches = [r for r in records if r["same_as_plain"] is False]
    for batch in sorted({r["batch"] for r in records}):
        print(f"\n## batch {batch}\n")
        print("| category | plain | " + "".join(f"{n} | " for n in fixed) + f"{dynamic} | best fixed | dynamic / best fixed "
              "| dynamic / plain | " + "".join(f"{n} / plain | " for n in control) + "dynamic's steps by drafts |")
        print("|---|" + "---|" * (len(fixed) + len(control) + 6))
        ratios_best, ratios_plain, totals = [], [], {n: [0, 0.0] for n in names}
        for category in dict.fromkeys(r["category"] for r in records if r["batch"] == batch):
            rate, steps = {}, []
            for name in names:
                rs = [r for r in records if r["batch"] == batch and r["category"] == category and r["config"] == name]
                rate[name] = statistics.median(r["tokens"] / r["seconds"] for r in rs)
                totals[name][0] += sum(r["tokens"] for r in rs)
                totals[name][1] += sum(r["seconds"] for r in rs)
                if name == dynamic:
                    steps = [sum(col) for col in itertools.zip_longest(*[r["steps_by_draft_length"] for r in rs], fillvalue=0)]
            best = max(fixed, key=lambda n: rate[n]) if fixed else "plain"
            ratios_best.append(rate[dynamic] / rate[best])
            ratios_plain.append(rate[dynamic] / rate["plain"])
            controls = "".join(f"{rate[n] / rate['plain']:.2f}x | " for n in control)
            print(f"| {category} | {rate['plain']:.1f} | " + "".join(f"{rate[n]:.1f} | " for n in fixed)
                  + f"{rate[dynamic]:.1f} | {best} | {ratios_best[-1]:.2f}x | {ratios_plain[-1]:.2f}x | {controls}{steps} |")
        whole = {n: t / s for n, (t, s) in totals.items()}
        controls = "".join(f"{whole[n] / whole['plain']:.2f}x | " for n in control)
        print(f"| **all** | {whole['plain']:.1f} | " + "".join(f"{whole[n]:.1f} | " for n in fixed)
              + f"{whole[dynamic]:.1f} | | min {min(ratios_best):.2f}x | min {min(ratios_plain):.2f}x | {controls}|")
    print(f"\n{rounds} rounds per cell; greedy outputs differing from plain: {len(mismatches)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
