"""How many tokens should n-gram prompt lookup propose? Replay greedy answers under several rules.

Greedy decoding is deterministic, so one plain run gives every answer the
target would write; replaying an answer token by token shows exactly which
drafts a rule would propose and how many the target would accept, without
running speculation for every rule. What a step costs comes from this
machine: the target's forward over m = 1 .. k_max + 1 rows at batch 1 is
timed first (fbgemm's fp16 GEMM grows in steps with the row count, so the
cost is not linear in the number of drafts).

    python benchmarks/ngram_draft_length.py --categories summarization,code_editing
    python benchmarks/ngram_draft_length.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --categories summarization --limit 48

Printed per rule and category: the modelled speed-up over plain decoding,
sum(tokens) / sum(step cost), with a plain step = 1, and tau (tokens per step).
Prefill is left out (it is the same with and without speculation).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchmark import DEFAULT_PROMPTS, load_prompts  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.model_executor.layers.attention import tree_layout  # noqa: E402
from specserve.sample.tree_sampler import walk_tree  # noqa: E402
from specserve.spec_decode.ngram import ngram_lookup, ngram_tree  # noqa: E402
from specserve.worker.model_runner import ForwardInput  # noqa: E402

# (name, min_n, max_n, k, adaptive)
RULES = [
    ("fixed k=4, n 2..4", 2, 4, 4, False),
    ("fixed k=5, n 2..3", 2, 3, 5, False),
    ("fixed k=4, n 1..4", 1, 4, 4, False),
    ("min(k, n), k=4, n 1..4", 1, 4, 4, True),
    ("min(k, n), k=5, n 1..5", 1, 5, 5, True),
    ("min(k, n), k=6, n 1..6", 1, 6, 6, True),
    ("min(k, n), k=8, n 1..8", 1, 8, 8, True),
    # Trees of earlier continuations (prompt_lookup_tree) of at most min(k, n + extra) tokens.
    ("tree, k=5, n 1..5, extra 0", 1, 5, 5, "tree", 0),
    ("tree, k=5, n 1..5, extra 1", 1, 5, 5, "tree", 1),
    ("tree, k=5, n 1..5, extra 2 (the shipped tree)", 1, 5, 5, "tree", 2),
    ("tree, k=5, n 1..5, extra 3", 1, 5, 5, "tree", 3),
    ("tree, k=4, n 1..4, extra 2", 1, 4, 4, "tree", 2),
    ("tree, k=6, n 1..6, extra 2", 1, 6, 6, "tree", 2),
]


def step_costs(llm: LLM, max_rows: int, context: int = 250, rounds: int = 15) -> list[float]:
    """cost[m] = time of a batch-1 forward over m new rows / time over 1 row (m = 0 unused).

    Row counts are timed round-robin (1, 2, ..., max_rows, 1, 2, ...) and the
    median per count is kept, so a slow spell of a shared machine hits every
    count alike instead of skewing one of them.
    """
    runner = llm.engine.runner
    block_size = llm.engine.config.block_size
    blocks = list(range(1, (context + max_rows) // block_size + 2))
    runner.execute([ForwardInput(list(range(100, 100 + context)), 0, blocks, 1)])
    samples: dict[int, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for m in range(1, max_rows + 1):
            inp = [ForwardInput(list(range(200, 200 + m)), context, blocks, m)]
            t = time.perf_counter()
            runner.execute(inp)
            samples[m].append(time.perf_counter() - t)
    median = {m: statistics.median(ts) for m, ts in samples.items()}
    return [0.0] + [median[m] / median[1] for m in range(1, max_rows + 1)]


def replay(prompt: list[int], answer: list[int], rule, cost: list[float]) -> tuple[int, float, int]:
    """(tokens after the first, summed step cost, steps) of speculative decoding with ``rule``."""
    _, min_n, max_n, k, adaptive, *extra = rule
    tokens = np.asarray(prompt + answer, dtype=np.int64)
    i, total_cost, steps = 1, 0.0, 0   # the first answer token comes from the prefill
    while i < len(answer):
        remaining = len(answer) - i - 1
        if adaptive == "tree":
            drafts, parents = ngram_tree(tokens[: len(prompt) + i], min_n, max_n, min(k, remaining), *extra)
            # The target's greedy choice after the accepted prefix is the answer's next token.
            depth = [d + 1 for d in tree_layout(parents)[0]]   # position of each draft after the last token
            choices = [answer[i]] + [answer[i + depth[j]] if i + depth[j] < len(answer) else -1
                                     for j in range(len(drafts))]
            accepted = len(walk_tree(drafts, parents, choices)[1])
        else:
            drafts = ngram_lookup(tokens[: len(prompt) + i], min_n, max_n, min(k, remaining), adaptive)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == answer[i + accepted]:
                accepted += 1
        total_cost += cost[len(drafts) + 1]
        steps += 1
        i += accepted + 1
    return len(answer) - 1, total_cost, steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--categories", default=None)
    ap.add_argument("--limit", type=int, default=None, help="at most this many prompts per category")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = load_prompts(args.prompts, categories, args.limit)

    llm = LLM()
    max_rows = max(r[3] for r in RULES) + 1
    cost = step_costs(llm, max_rows)
    print("cost of a forward over m rows / 1 row: "
          + ", ".join(f"{m}: {c:.2f}" for m, c in enumerate(cost) if m), flush=True)

    t = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p.text}] for p in prompts],
                    SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    print(f"{len(prompts)} greedy answers in {time.perf_counter() - t:.0f}s\n")

    cats = sorted({p.category for p in prompts})
    print("| rule | " + " | ".join(cats) + " | all |")
    print("|---|" + "---|" * (len(cats) + 1))
    for rule in RULES:
        sums = defaultdict(lambda: [0, 0.0, 0])
        for p, o in zip(prompts, outs):
            n, c, s = replay(list(o.prompt_token_ids), list(o.outputs[0].token_ids), rule, cost)
            for key in (p.category, "all"):
                sums[key][0] += n
                sums[key][1] += c
                sums[key][2] += s
        cells = [f"{sums[c][0] / sums[c][1]:.2f}x (tau {sums[c][0] / sums[c][2]:.2f})" for c in cats + ["all"]]
        print(f"| {rule[0]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
