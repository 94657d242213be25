"""Draft length chosen per step (``dynamic_k``) against a fixed k and plain decoding.

One Spec-Bench question per category (the first ``--questions`` categories), chat
formatted, greedy, ``--max-tokens`` new tokens, batch 1; the three engines answer each
question in rotating order. Reported: whole-answer tokens/s (prompt included) and how
many decode steps carried 0, 1, 2, ... drafts (``steps_by_draft_length``).

    python benchmarks/dynamic_k.py --method draft_model --fixed-k 4 --max-k 6
    python benchmarks/dynamic_k.py --method ngram --fixed-k 4 --max-k 6
"""
from __future__ import annotations

import argparse
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC_BENCH = os.path.join(HERE, "..", "..", "shared", "data", "spec_bench", "question.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="ngram", choices=["ngram", "draft_model", "suffix", "eagle"])
    p.add_argument("--fixed-k", type=int, default=4)
    p.add_argument("--max-k", type=int, default=6, help="dynamic_k's maximum")
    p.add_argument("--questions", type=int, default=13)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", default=SPEC_BENCH)
    args = p.parse_args()

    from specserve import LLM, SamplingParams

    by_category: dict[str, dict] = {}
    for line in open(args.prompts):
        row = json.loads(line)
        by_category.setdefault(row["category"], row)
    questions = list(by_category.values())[: args.questions]
    configs = {
        "plain": None,
        f"{args.method} k={args.fixed_k}": {"method": args.method, "num_speculative_tokens": args.fixed_k},
        f"{args.method} dynamic, k<={args.max_k}": {"method": args.method, "num_speculative_tokens": args.max_k,
                                                    "dynamic_k": True},
    }
    engines = {name: LLM(speculative_config=spec, max_model_len=2048) for name, spec in configs.items()}
    totals = {name: [0, 0.0] for name in engines}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for i, q in enumerate(questions):
        names = list(engines)
        names = names[i % len(names):] + names[: i % len(names)]
        for name in names:
            llm = engines[name]
            ids = llm.apply_chat_template([{"role": "user", "content": q["turns"][0]}])
            start = time.perf_counter()
            out = llm.generate(ids, params, use_tqdm=False)[0]
            totals[name][1] += time.perf_counter() - start
            totals[name][0] += len(out.outputs[0].token_ids)
    plain = totals["plain"][0] / totals["plain"][1]
    print(f"{len(questions)} questions, max_tokens={args.max_tokens}, greedy, batch 1")
    print("| configuration | tok/s | x plain | decode steps by number of drafts (0, 1, ...) |")
    print("|---|---|---|---|")
    for name, (tokens, seconds) in totals.items():
        rate = tokens / seconds
        lengths = engines[name].get_spec_decode_stats().as_dict()["steps_by_draft_length"]
        print(f"| {name} | {rate:.1f} | {rate / plain:.2f}x | {lengths} |")


if __name__ == "__main__":
    main()
