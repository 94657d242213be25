"""Suffix decoding on a repeated-task (agentic) workload: plain vs n-gram vs suffix at batch 1.

Two tasks (``--task``), each many similar requests one after another, greedy, on the
default model:

- ``rename``: the same code-editing instruction ("rename a variable") applied to small,
  programmatically varied Python functions (short answers: ~31 tokens);
- ``json``: a tool step of an agent: a few customer records, given as text, converted to
  a JSON list with fixed keys (answers of ~100-200 tokens, the same structure every time,
  the values copied from the prompt).
 Requests are interleaved: request i runs on every config, in an
order rotated per request, so a slow spell of the shared machine hits them alike.
Suffix decoding's global trie learns from the earlier answers; n-gram lookup
sees only the current request.

    python benchmarks/suffix_decoding.py --requests 60 --max-tokens 96 --suffix-max-spec-factor 1 2
    python benchmarks/suffix_decoding.py --task json --requests 60 --max-tokens 256
    python benchmarks/suffix_decoding.py --task json --requests 40 --max-tokens 256 --dynamic-k both
    python benchmarks/suffix_decoding.py --task json --requests 50 --max-tokens 256 --dynamic-k on \
        --suffix-k 8 16 --suffix-max-depth 8 16

``--model NAME`` runs another target (``qwen2.5-coder-1.5b-instruct``, say);
``--int8-activations on|both`` multiplies the target with int8 activations (``both``: every
config twice, the ``+int8`` ones compared with ``plain+int8``). ``--json-out FILE`` saves the
figures.

``--dynamic-k``: n-gram and suffix with a fixed k (``off``, the default here, although
the engine's default for both is ``dynamic_k`` on), with ``dynamic_k`` (``on``), or ``both``.

Printed: per config tokens/s (output tokens over the wall time of the requests,
prefill included), the ratio to plain, tau (tokens per decode step) and the
acceptance rate; the same for the second half of the requests (the global trie
then holds at least as many earlier answers).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import torch

from specserve import LLM, SamplingParams

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
SETTINGS = {"off": [False], "on": [True], "both": [False, True]}   # --dynamic-k and --int8-activations


def plain_for(name: str) -> str:
    """The plain configuration a configuration is compared with: the one with the same activations
    (int8 rounding changes the target model)."""
    return "plain+int8" if name.endswith("+int8") else "plain"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="rename")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--suffix-k", type=int, nargs="+", default=[8], help="one suffix config per k")
    p.add_argument("--suffix-min-token-prob", type=float, nargs="+", default=[0.1], help="one suffix config per value")
    p.add_argument("--suffix-max-depth", type=int, nargs="+", default=[8],
                   help="one depth for every --suffix-k, or one per k")
    p.add_argument("--suffix-max-spec-factor", type=float, nargs="+", default=[1.0],
                   help="one suffix config per value")
    p.add_argument("--dynamic-k", choices=["off", "on", "both"], default="off",
                   help="n-gram and suffix with a fixed k (off; the engine's default is on), with dynamic_k, or both")
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--int8-activations", choices=["off", "on", "both"], default="off",
                   help="the target's activations: float32 (off, the default), int8 (on), or each config both ways")
    p.add_argument("--records", type=int, default=3, help="customer records per json request")
    p.add_argument("--json-out", default=None, help="write the figures to this file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per config first (other inputs)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    configs = {"plain": None}
    for dynamic in SETTINGS[args.dynamic_k]:
        tag = " dyn" if dynamic else ""
        configs[f"ngram k={args.ngram_k}{tag}"] = {"method": "ngram", "num_speculative_tokens": args.ngram_k,
                                                    "dynamic_k": dynamic}
        depths = args.suffix_max_depth if len(args.suffix_max_depth) > 1 else args.suffix_max_depth * len(args.suffix_k)
        for k, depth in zip(args.suffix_k, depths):
            for factor, prob in itertools.product(args.suffix_max_spec_factor, args.suffix_min_token_prob):
                name = (f"suffix k={k}" + (f" d={depth}" if depth != p.get_default("suffix_max_depth")[0] else "")
                        + f" f={factor:g}"
                        + (f" p={prob:g}" if prob != p.get_default("suffix_min_token_prob")[0] else "") + tag)
                configs[name] = {
                    "method": "suffix", "num_speculative_tokens": k,
                    "suffix_min_token_prob": prob, "suffix_max_depth": depth,
                    "suffix_max_spec_factor": factor, "dynamic_k": dynamic}
    int8_modes = SETTINGS[args.int8_activations]
    if len(int8_modes) > 1:   # every config both ways; "+int8" marks the int8 ones
        configs = {f"{name}{'+int8' if int8 else ''}": (spec, int8) for int8 in int8_modes for name, spec in configs.items()}
    else:
        configs = {name: (spec, int8_modes[0]) for name, spec in configs.items()}
    model = {"model": args.model} if args.model else {}
    engines = {name: LLM(speculative_config=spec, int8_activations=int8, **model) for name, (spec, int8) in configs.items()}
    first = next(iter(engines.values()))
    print(f"model: {first.engine.model_name}, torch threads: {torch.get_num_threads()}, "
          f"task {args.task}, {args.requests} requests, max_tokens {args.max_tokens}, greedy, batch 1, "
          f"int8 activations {args.int8_activations}")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    texts = TASKS[args.task](args.requests + args.warmup, records=args.records) if args.task == "json" \
        else TASKS[args.task](args.requests + args.warmup)
    ids = [first.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    for llm in engines.values():
        for prompt in ids[args.requests:]:
            llm.generate([prompt], params, use_tqdm=False)

    names = list(engines)
    elapsed = {n: [0.0, 0.0] for n in names}    # [first half, second half]
    produced = {n: [0, 0] for n in names}
    stats_at = {n: [] for n in names}
    answers = {n: [] for n in names}
    half = args.requests // 2
    for i, prompt in enumerate(ids[: args.requests]):
        if i in (0, half):
            for n in names:
                stats_at[n].append(_snapshot(engines[n]))
        order = names[i % len(names):] + names[: i % len(names)]
        for n in order:
            t = time.perf_counter()
            out = engines[n].generate([prompt], params, use_tqdm=False)[0].outputs[0]
            elapsed[n][i >= half] += time.perf_counter() - t
            produced[n][i >= half] += len(out.token_ids)
            answers[n].append(out.token_ids)
        if (i + 1) % 10 == 0:
            print(f"# {i + 1} of {args.requests} requests, " + ", ".join(
                f"{n} {sum(produced[n]) / sum(elapsed[n]):.1f} tok/s" for n in names), flush=True)
    for n in names:
        stats_at[n].append(_snapshot(engines[n]))
        assert answers[n] == answers[plain_for(n)], f"{n}: greedy output differs from {plain_for(n)}"

    mean_len = sum(map(len, answers["plain"])) / len(answers["plain"])
    print(f"mean output length {mean_len:.1f} tokens; every config's output == plain's (same activations)")
    figures = {"args": vars(args), "model": first.engine.model_name, "mean_output_tokens": mean_len}
    for label, part in (("all requests", None), ("second half", 1)):
        print(f"\n{label}:")
        print(f"{'config':>28} {'tok/s':>8} {'x plain':>8} {'tau':>6} {'accept':>7}")
        rate = {}
        for n in names:
            secs = sum(elapsed[n]) if part is None else elapsed[n][part]
            toks = sum(produced[n]) if part is None else produced[n][part]
            rate[n] = toks / secs
            a, b = (stats_at[n][0], stats_at[n][2]) if part is None else (stats_at[n][1], stats_at[n][2])
            steps, emitted, drafted, accepted = (b[j] - a[j] for j in range(4))
            tau = emitted / steps if steps else float("nan")
            acc = accepted / drafted if drafted else 0.0
            x_plain = rate[n] / rate[plain_for(n)]
            print(f"{n:>28} {rate[n]:8.1f} {x_plain:8.2f} {tau:6.2f} {acc:7.2f}")
            figures.setdefault(label, {})[n] = {"tok_s": rate[n], "x_plain": x_plain, "tau": tau,
                                                "acceptance": acc, "seconds": secs, "tokens": toks}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(figures, f, indent=1)


def _snapshot(llm: LLM) -> tuple[int, int, int, int]:
    s = llm.get_spec_decode_stats()
    return s.num_steps, s.num_emitted_tokens, s.num_draft_tokens, s.num_accepted_tokens


if __name__ == "__main__":
    main()
