"""dynamic_k against every fixed k, replayed: the policy's choices without the machine's noise.

Greedy decoding is deterministic, so one plain run gives every answer the target writes,
and n-gram's proposals depend only on the tokens so far: replaying an answer token by
token shows exactly what each configuration would draft and how much of it the target
would accept (``ngram_draft_length.py`` does this for fixed rules). Here the replay also
runs ``dynamic_k`` itself: the engine's ``Drafting`` (its ``DraftLengthPolicy`` and
``ShadowDrafts``), fed the same proposals in the same order (requests one after another,
as at batch 1, the engine-wide acceptance carried from one to the next), with the
forward's cost by row count timed on this machine first (``step_costs``: medians of
round-robin timings, relative to one row). A step costs the forward over its rows; the
rest of a step (scheduling, sampling) and the prefill are left out, the same for every
configuration.

So a configuration's figure is its modelled speed-up over plain decoding, identical from
run to run: the gap between ``dynamic_k`` and the best fixed k here is the policy's own,
not the noise that a timed run (``dynamic_k.py``) has to average away.

    python benchmarks/dynamic_k_replay.py --questions 4
    python benchmarks/dynamic_k_replay.py --model qwen2.5-coder-1.5b-instruct --questions 4 --max-tokens 64
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch
from ngram_draft_length import replay, step_costs  # benchmarks/: the fixed rules' replay, the cost curve
from spec_bench import SPEC_BENCH

from specserve import LLM, SamplingParams
from specserve.bench.options import load_prompts
from specserve.config import SpeculativeConfig
from specserve.core.request import Request, RequestStatus
from specserve.core.scheduler import ScheduledRequest
from specserve.engine.drafting import Drafting, calibration_rows
from specserve.outputs import SpecDecodeStats
from specserve.spec_decode.k_policy import DraftLengthPolicy
from specserve.spec_decode.ngram import NgramProposer


class DynamicReplay:
    """dynamic_k's choices over replayed answers, one request after another (batch 1): the
    engine's own ``Drafting`` (n-gram's full proposal, ``ShadowDrafts`` scoring, the
    ``DraftLengthPolicy`` cut) fed real ``Request``s step by step, so the replay runs the
    very code an engine step runs, not a copy of it."""

    def __init__(self, max_k: int, cost: list[float], min_n: int, max_n: int) -> None:
        self.policy = DraftLengthPolicy(max_k)
        for rows in calibration_rows(max_k):
            self.policy.calibrate_forward(rows, cost[rows])
        self.drafting = Drafting(None, self.policy, SpecDecodeStats())
        self.proposer = NgramProposer(min_n, max_n)
        self.max_k, self.cost = max_k, cost

    def answer(self, prompt: list[int], answer: list[int]) -> tuple[int, float, int]:
        """(tokens after the first, summed step cost, steps), as ``replay`` counts them."""
        request = Request("replay", None, prompt, SamplingParams(temperature=0.0, max_tokens=len(answer)), None, None)
        request.status = RequestStatus.RUNNING
        request.append_token(answer[0])   # the first answer token comes from the prefill
        i, total_cost, steps = 1, 0.0, 0
        while i < len(answer):
            request.num_computed_tokens = request.num_tokens - 1
            step = ScheduledRequest(request, num_new_tokens=1, num_lookahead=min(self.max_k, len(answer) - i - 1))
            self.drafting.propose_or_skip(self.proposer, [step])
            drafts = request.draft_token_ids
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == answer[i + accepted]:
                accepted += 1
            total_cost += self.cost[len(drafts) + 1]
            steps += 1
            request.clear_drafts()
            for token in answer[i : i + accepted + 1]:   # the accepted drafts and the target's own token
                request.append_token(token)
            i += accepted + 1
            if i >= len(answer):
                request.status = RequestStatus.FINISHED_LENGTH
            self.drafting.score_proposals([step])
        return len(answer) - 1, total_cost, steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--categories", default=None, help="comma-separated (default: all)")
    p.add_argument("--questions", type=int, default=4, help="questions per category")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fixed-ks", default="1,2,3,4")
    p.add_argument("--max-k", type=int, default=4, help="dynamic_k's maximum")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", default=SPEC_BENCH)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    questions = load_prompts(args.prompts, args.categories.split(",") if args.categories else None, args.questions)
    llm = LLM(model=args.model, max_model_len=2048, kv_cache_memory=1 << 30, enable_prefix_caching=False)
    fixed = [int(k) for k in args.fixed_ks.split(",") if k]
    cost = step_costs(llm, max(fixed + [args.max_k]) + 1)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} forward over m rows / 1 row: "
          + ", ".join(f"{m}: {c:.3f}" for m, c in enumerate(cost) if m), flush=True)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q.text}]) for q in questions]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                        use_tqdm=False)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.max_k)   # the engine's n-gram defaults
    min_n, max_n = spec.prompt_lookup_min, spec.prompt_lookup_max

    names = ["plain"] + [f"k={k}" for k in fixed] + [f"dynamic k<={args.max_k}"]
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0])   # (config, category)
    dynamic = DynamicReplay(args.max_k, cost, min_n, max_n)
    for q, out in zip(questions, outs):   # in order: dynamic_k's engine-wide figures carry over
        prompt, answer = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        results = {"plain": (len(answer) - 1, float(len(answer) - 1), len(answer) - 1)}
        for k in fixed:
            results[f"k={k}"] = replay(prompt, answer, (f"k={k}", min_n, max_n, k, True), cost)
        results[names[-1]] = dynamic.answer(prompt, answer)
        for name, (tokens, total, steps) in results.items():
            for key in ((name, q.category), (name, "all")):
                sums[key][0] += tokens
                sums[key][1] += total
                sums[key][2] += steps

    categories = list(dict.fromkeys(q.category for q in questions)) + ["all"]
    print("\nModelled speed-up over plain decoding (tokens / summed forward cost, a 1-row forward = 1):\n")
    print("| category | " + " | ".join(names[1:]) + " | best fixed | dynamic / best fixed |")
    print("|---|" + "---|" * (len(names) + 1))
    worst = 2.0
    for c in categories:
        speed = {n: sums[(n, c)][0] / sums[(n, c)][1] for n in names}
        best = max(names[1:-1], key=lambda n: speed[n])
        ratio = speed[names[-1]] / speed[best]
        worst = min(worst, ratio)
        print(f"| {c} | " + " | ".join(f"{speed[n]:.3f}x" for n in names[1:]) + f" | {best} | {ratio:.3f}x |")
    print(f"\nlowest dynamic / best fixed: {worst:.3f}x; dynamic's steps by drafts: {dynamic.policy.steps_by_k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
