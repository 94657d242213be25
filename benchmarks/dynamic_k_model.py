"""Is dynamic_k's model right? Its predicted step costs and tokens against what the steps did.

At batch 1, every decode step of a ``dynamic_k`` engine is logged twice: what the policy
predicted when it chose the draft length (``DraftLengthPolicy.choose``: the forward's
cost for the rows it verifies, the whole step's cost with the overhead and the draft,
the expected tokens emitted) and what happened (the forward's and the step's measured
time, the tokens emitted). Fixed-k engines and plain decoding answer the same questions,
interleaved question by question in a rotating order, so their step times by row
count are there to compare with.

    python benchmarks/dynamic_k_model.py --categories humanities,math,reasoning --questions 5

Printed: each configuration's total time and speed-up over plain; per row count, the
number of decode steps, median forward and step milliseconds and mean tokens emitted,
and for ``dynamic_k`` the medians of its predictions beside them. If the predictions
match, a gap between ``dynamic_k`` and the best fixed k is not the cost model's.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

from spec_bench import SPEC_BENCH   # benchmarks/spec_bench.py (this script's folder is on sys.path)


class StepLog:
    """Wraps the policy's ``choose`` and the engine's ``record_step_costs`` to log each decode step."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.pending: dict | None = None             # the last choice, until its step is recorded
        self.outputs_before: dict[str, int] = {}     # request id -> output tokens before the step

    def install(self, policy_cls, drafting_cls) -> None:
        log, choose, record = self, policy_cls.choose, drafting_cls.record_step_costs

        def logged_choose(policy, rates, limits, probe):
            chosen = choose(policy, rates, limits, probe)
            forward = policy.forward(sum(k + 1 for k in chosen))
            log.pending = {
                "expected_tokens": sum(1 + sum(r[:k]) for r, k in zip(rates, chosen)),
                "forward": forward,
                "step": forward + policy.overhead_seconds + policy.draft_seconds_per_position * max(chosen)}
            return chosen

        def logged_record(drafting, scheduled, inputs, step_started, forward_started, verified_at):
            now = time.perf_counter()
            if all(s.num_new_tokens == 1 for s in scheduled):
                emitted = sum(len(s.request.output_token_ids) - log.outputs_before.get(s.request.request_id, 0)
                              for s in scheduled)
                log.steps.append({"rows": sum(len(i.token_ids) for i in inputs), "forward": verified_at - forward_started,
                                  "step": now - step_started, "emitted": emitted, "predicted": log.pending})
            log.pending = None
            log.outputs_before = {s.request.request_id: len(s.request.output_token_ids) for s in scheduled}
            record(drafting, scheduled, inputs, step_started, forward_started, verified_at)

        policy_cls.choose = logged_choose
        drafting_cls.record_step_costs = logged_record

    def take(self) -> list[dict]:
        steps, self.steps, self.pending, self.outputs_before = self.steps, [], None, {}
        return steps


def summarize(name: str, steps: list[dict]) -> None:
    ms = 1e3
    print(f"\n{name}: {len(steps)} decode steps, {sum(s['emitted'] for s in steps) / max(1, len(steps)):.2f} "
          f"tokens a step, mean step {ms * statistics.mean(s['step'] for s in steps):.2f} ms")
    by_rows = collections.defaultdict(list)
    for s in steps:
        by_rows[s["rows"]].append(s)
    for rows in sorted(by_rows):
        group = by_rows[rows]
        line = (f"  rows {rows}: {len(group)} steps, forward {ms * statistics.median(s['forward'] for s in group):.2f} ms, "
                f"step {ms * statistics.median(s['step'] for s in group):.2f} ms, "
                f"emitted {statistics.mean(s['emitted'] for s in group):.2f}")
        predicted = [s["predicted"] for s in group if s["predicted"]]
        if predicted:
            line += (f" | predicted: forward {ms * statistics.median(p['forward'] for p in predicted):.2f} ms, "
                     f"step {ms * statistics.median(p['step'] for p in predicted):.2f} ms, "
                     f"tokens {statistics.mean(p['expected_tokens'] for p in predicted):.2f}")
        print(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--categories", default=None, help="comma-separated (default: all)")
    p.add_argument("--questions", type=int, default=5, help="questions per category")
    p.add_argument("--fixed-ks", default="1,2,3,4")
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", default=SPEC_BENCH)
    args = p.parse_args()

    import torch

    from specserve import LLM, SamplingParams
    from specserve.bench.options import load_prompts
    from specserve.engine.drafting import Drafting
    from specserve.spec_decode.k_policy import DraftLengthPolicy
    torch.set_num_threads(args.threads)

    log = StepLog()
    log.install(DraftLengthPolicy, Drafting)
    questions = [q.text for q in load_prompts(args.prompts, args.categories.split(",") if args.categories else None,
                                              args.questions)]
    configs = {f"dynamic k<={args.max_k}": {"method": args.method, "num_speculative_tokens": args.max_k,
                                            "dynamic_k": True}}
    configs.update({f"k={k}": {"method": args.method, "num_speculative_tokens": int(k), "dynamic_k": False}
                    for k in args.fixed_ks.split(",") if k})
    configs["plain"] = None
    engines = {name: LLM(model=args.model, speculative_config=spec, max_model_len=2048, kv_cache_memory=1 << 30,
                         enable_prefix_caching=False) for name, spec in configs.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [engines["plain"].apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    for llm in engines.values():   # warm-up
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    log.take()
    names = list(engines)
    seconds = collections.defaultdict(float)
    steps = collections.defaultdict(list)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {args.method}, {len(prompts)} questions, {args.max_tokens} tokens, "
          f"batch 1, threads {args.threads}")
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            started = time.perf_counter()
            engines[name].generate([prompt], params, use_tqdm=False)
            seconds[name] += time.perf_counter() - started
            steps[name].extend(log.take())
    print("seconds: " + ", ".join(f"{n} {seconds[n]:.2f}" for n in names))
    print("x plain: " + ", ".join(f"{n} {seconds['plain'] / seconds[n]:.3f}" for n in names))
    for name in names:
        summarize(name, steps[name])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
