"""Suffix decoding on a repeated-task (agentic) workload: plain vs n-gram vs suffix at batch 1.

Two tasks (``--task``), each many similar requests one after another, greedy:

- ``rename``: the same code-editing instruction ("rename a variable") applied to small,
  programmatically varied Python functions (short answers: ~31 tokens);
- ``json``: a tool step of an agent: a few customer records, given as text, converted to
  a JSON list with fixed keys (answers of ~100-200 tokens, the same structure every time,
  the values copied from the prompt).

Requests are interleaved: request i runs on every configuration, in an order rotated per request,
so a slow spell of the machine hits all alike. Suffix decoding's global tree learns from earlier
answers; n-gram sees only the current request. ``--dynamic-k``: n-gram and suffix with a fixed k
(``off``), with ``dynamic_k`` (``on``, the engine's default) or ``both``. Reported per
configuration: tok/s (output tokens over the requests' wall time, prefill included), the ratio to
plain, tau (tokens per decode step) and the acceptance rate, over all requests and over the second
half (the tree then holds at least as many earlier answers). Every configuration's greedy output
is checked equal to plain's.
"""
from __future__ import annotations

import random
import time

from specserve.bench.results import fmt

FUNCTIONS = [
    "def {f}({x}, {y}):\n    {x} = {x} + {c}\n    if {x} > {y}:\n        return {x} - {y}\n    return {y} * {c}\n",
    "def {f}(items):\n    {x} = 0\n    for {y} in items:\n        if {y} % {c} == 0:\n            {x} += {y}\n"
    "    return {x}\n",
    "def {f}({y}):\n    {x} = []\n    for i in range({y}):\n        {x}.append(i * {c})\n    return {x}\n",
    "def {f}(text):\n    {x} = text.split()\n    {y} = len({x})\n    return {y} + {c}\n",
]
NAMES = ["total", "value", "result", "acc", "tmp", "data", "n", "k", "item", "score", "buf", "size"]
FUNCS = ["compute", "process", "update", "collect", "measure", "build", "count_words", "scale"]


def make_prompts(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        x, y, new = rng.sample(NAMES, 3)
        code = FUNCTIONS[i % len(FUNCTIONS)].format(f=rng.choice(FUNCS), x=x, y=y, c=rng.randint(2, 99))
        prompts.append(f"Rename the variable `{x}` to `{new}` in this Python function. "
                       f"Reply with only the new code.\n\n```python\n{code}```")
    return prompts


FIRST = ["Alice", "Bob", "Carol", "Dan", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Niaj"]
LAST = ["Smith", "Jones", "White", "Brown", "Taylor", "Clark", "Lewis", "Walker", "Young", "King"]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Dublin", "Oslo", "Athens"]
STATUS = ["active", "inactive", "pending"]


def make_json_prompts(num: int, seed: int = 0, records: int = 3) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        lines = []
        for _ in range(records):
            first, last = rng.choice(FIRST), rng.choice(LAST)
            lines.append(f"Name: {first} {last}\nAge: {rng.randint(18, 80)}\nCity: {rng.choice(CITIES)}\n"
                         f"Email: {first.lower()}.{last.lower()}@example.com\nStatus: {rng.choice(STATUS)}\n")
        prompts.append("Convert these customer records to a JSON list of objects with the keys name, age, city, "
                       "email and status. Reply with only the JSON.\n\n" + "\n".join(lines))
    return prompts


TASKS = {"rename": make_prompts, "json": make_json_prompts}
SETTINGS = {"off": [False], "on": [True], "both": [False, True]}


def add_arguments(p) -> None:
    p.add_argument("--task", choices=sorted(TASKS), default="json")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--suffix-k", type=int, nargs="+", default=[16], help="one suffix configuration per k")
    p.add_argument("--dynamic-k", choices=["off", "on", "both"], default="on",
                   help="n-gram and suffix with a fixed k (off), with dynamic_k (on, the engine's default), or both")
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--records", type=int, default=3, help="customer records per json request")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per configuration first (other inputs)")


def _snapshot(llm) -> tuple[int, int, int, int]:
    s = llm.get_spec_decode_stats()
    return s.num_steps, s.num_emitted_tokens, s.num_draft_tokens, s.num_accepted_tokens


def run(args, doc: dict) -> None:
    from specserve import LLM, SamplingParams

    doc["params"] = {k: getattr(args, k) for k in ("task", "requests", "max_tokens", "ngram_k", "suffix_k",
                                                    "dynamic_k", "model", "records", "warmup")}
    configs = {"plain": None}
    for dynamic in SETTINGS[args.dynamic_k]:
        tag = " dyn" if dynamic else ""
        configs[f"ngram k={args.ngram_k}{tag}"] = {"method": "ngram", "num_speculative_tokens": args.ngram_k,
                                                    "dynamic_k": dynamic}
        for k in args.suffix_k:
            configs[f"suffix k={k}{tag}"] = {"method": "suffix", "num_speculative_tokens": k, "dynamic_k": dynamic}
    model = {"model": args.model} if args.model else {}
    engines = {name: LLM(speculative_config=spec, **model) for name, spec in configs.items()}
    first = engines["plain"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    texts = (make_json_prompts(args.requests + args.warmup, records=args.records) if args.task == "json"
             else make_prompts(args.requests + args.warmup))
    ids = [first.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    for llm in engines.values():
        for prompt in ids[args.requests:]:
            llm.generate([prompt], params, use_tqdm=False)
    names = list(engines)
    samples = []
    stats_at = {n: [] for n in names}
    answers = {n: [] for n in names}
    half = args.requests // 2
    for i, prompt in enumerate(ids[: args.requests]):
        if i in (0, half):
            for n in names:
                stats_at[n].append(_snapshot(engines[n]))
        for n in names[i % len(names):] + names[: i % len(names)]:
            t = time.perf_counter()
            out = engines[n].generate([prompt], params, use_tqdm=False)[0].outputs[0]
            samples.append({"request": i, "config": n, "seconds": time.perf_counter() - t,
                            "tokens": len(out.token_ids)})
            answers[n].append(list(out.token_ids))
    for n in names:
        stats_at[n].append(_snapshot(engines[n]))
        if answers[n] != answers["plain"]:
            raise RuntimeError(f"{n}: greedy output differs from plain decoding's")
    rows = []
    for label, part in (("all", None), ("second half", 1)):
        rate = {}
        for n in names:
            mine = [s for s in samples if s["config"] == n and (part is None or s["request"] >= half)]
            rate[n] = sum(s["tokens"] for s in mine) / sum(s["seconds"] for s in mine)
            a, b = (stats_at[n][0], stats_at[n][2]) if part is None else (stats_at[n][1], stats_at[n][2])
            steps, emitted, drafted, accepted = (b[j] - a[j] for j in range(4))
            rows.append([label, f"`{n}`", fmt(rate[n]), "—" if n == "plain" else fmt(rate[n] / rate["plain"], 2, "x"),
                         fmt(emitted / steps, 2) if steps and n != "plain" else "—",
                         fmt(accepted / drafted, 2) if drafted else "—"])
    mean_len = sum(map(len, answers["plain"])) / len(answers["plain"])
    doc["table"] = {"columns": ["requests", "configuration", "tok/s", "vs plain", "tau", "acceptance"], "rows": rows}
    doc["notes"] = [f"Model {first.engine.model_name}, task {args.task}, {args.requests} requests at batch 1, greedy, "
                    f"{args.max_tokens} tokens at most (mean answer {mean_len:.0f}); every configuration's output "
                    "equals plain's."]
    doc["samples"] = samples
