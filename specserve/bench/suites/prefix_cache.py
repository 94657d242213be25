"""Time to first token with and without automatic prefix caching, side by side.

Three workloads, each replayed on two engines of the same model (``enable_prefix_caching``
on and off) per configuration (``--configs``: plain, or speculation as in ``specserve bench
--configs``; with EAGLE the cached blocks carry its head's K/V too), in alternating order,
request by request:

- ``multi-turn``: Spec-Bench's two-turn questions (``--prompts``; the 80 with two
  turns) as conversations. Turn 1 is answered (greedy, ``--answer-tokens``), then turn 2
  resends the whole conversation, as chat clients do. Reported: turn 2's time to first
  token (TTFT) on each engine, per category and in all.
- ``long-chat``: conversations of ``--turns`` user turns (this file's QUESTIONS, a
  different rotation per conversation), each turn answered greedily and the whole
  conversation resent for the next. Reported: TTFT by turn number (2, 3, ...).
- ``system-prompt``: one long system prompt (an agent's instructions, ~700 tokens)
  with ``--limit`` different short questions after it, one request after another.

TTFT is the wall time of a request with ``max_tokens=1``: tokenized prompt in, first
token out (prefill plus one sample), on one thread of the engine. ``--tokens N`` times
the first N tokens instead: a draft model or an EAGLE head computes its own K/V over
the prompt after the first token, at its first draft, so a cached prefix saves time
there too when the cache carries the proposer's K/V.

    specserve bench prefix-cache --limit 16 --answer-tokens 64
    specserve bench prefix-cache --workloads long-chat --limit 6 --turns 5
    specserve bench prefix-cache --model qwen2.5-coder-1.5b-instruct --limit 8
    specserve bench prefix-cache --configs plain,eagle:4
    specserve bench prefix-cache --configs plain,draft:3,eagle:4 --tokens 9

Reported per workload and configuration: mean TTFT with and without caching and the ratio; the
raw times (per category or turn) are the results file's samples.
"""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

from specserve.bench.options import prompts_path
from specserve.bench.results import fmt

WORKLOADS = ("multi-turn", "long-chat", "system-prompt")


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="anything LLM(model=...) accepts (default: the default model)")
    p.add_argument("--prompts", default="spec-bench", help="Spec-Bench JSONL (two-turn questions are used)")
    p.add_argument("--limit", type=int, default=16, help="requests per workload")
    p.add_argument("--answer-tokens", type=int, default=64, help="tokens of each turn-1 answer")
    p.add_argument("--workloads", default="multi-turn,system-prompt", help="any of " + ", ".join(WORKLOADS))
    p.add_argument("--turns", type=int, default=5, help="user turns per long-chat conversation")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1,
                   help="time the first N tokens of each timed request (default 1: time to first token)")
    p.add_argument("--configs", default="plain",
                   help="what the engines run, as `specserve bench --configs` takes (plain, ngram:4, eagle:4, ...): "
                        "two engines each, caching on and off")


SYSTEM_PROMPT = " ".join([
    "You are a coding agent working in a large Python repository.",
    "Follow these rules in every answer.",
    "Read the files you are shown before you change them, and never invent an API that is not in them.",
    "Keep each change small, explain it in one sentence, and show the whole changed function.",
    "Prefer the standard library; name every new dependency and say why it is needed.",
    "Write type hints, docstrings where the reason is not obvious, and tests that can fail.",
    "When a request is ambiguous, state the assumption you make and go on.",
    "Never remove a test to make the suite pass; fix the code or explain why the test is wrong.",
] * 6)

QUESTIONS = [
    "How do I read a CSV file into a list of dicts?", "Write a function that reverses a linked list.",
    "Explain what a context manager is.", "How do I retry an HTTP request with backoff?",
    "Write a unit test for a function that parses dates.", "How do I profile a slow function?",
    "What is the difference between a list and a tuple?", "How do I merge two sorted lists?",
    "Write a dataclass for a 2D point with a distance method.", "How do I run a subprocess with a timeout?",
    "How do I cache the results of a pure function?", "Write a generator that yields prime numbers.",
    "How do I read environment variables with defaults?", "What does __slots__ do?",
    "How do I flatten a nested list?", "Write a function that checks balanced brackets.",
]


def ttft(llm, prompt_ids: list[int], tokens: int = 1) -> float:
    """Seconds to the first ``tokens`` tokens (greedy)."""
    from specserve import SamplingParams

    start = time.perf_counter()
    llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start


def chat_ids(llm, messages: list[dict]) -> list[int]:
    return llm.apply_chat_template(messages, add_generation_prompt=True)


def answer(llm, messages: list[dict], max_tokens: int) -> str:
    from specserve import SamplingParams

    out = llm.generate(chat_ids(llm, messages), SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return out[0].outputs[0].text


def multi_turn(engines: dict, args) -> dict:
    rows = [json.loads(line) for line in open(prompts_path(args.prompts)) if line.strip()]
    rows = [r for r in rows if len(r.get("turns", [])) >= 2][: args.limit]
    times: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in engines}
    prompt_lens = []
    for i, row in enumerate(rows):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            llm = engines[name]
            first = [{"role": "user", "content": row["turns"][0]}]
            reply = answer(llm, first, args.answer_tokens)
            second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": row["turns"][1]}]
            ids = chat_ids(llm, second)
            times[name][row["category"]].append(ttft(llm, ids, args.tokens))
        prompt_lens.append(len(ids))
    return {"times": times, "prompt_tokens": statistics.mean(prompt_lens), "requests": len(rows)}


def long_chat(engines: dict, args) -> dict:
    """Turns 2..N of conversations of N user turns: TTFT by turn number."""
    times: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in engines}
    prompt_lens = []
    for c in range(args.limit):
        questions = [QUESTIONS[(c * 3 + t) % len(QUESTIONS)] for t in range(args.turns)]
        order = list(engines) if c % 2 == 0 else list(reversed(engines))
        for name in order:
            llm, messages = engines[name], []
            for t, q in enumerate(questions):
                messages.append({"role": "user", "content": q})
                if t > 0:
                    ids = chat_ids(llm, messages)
                    times[name][f"turn {t + 1}"].append(ttft(llm, ids, args.tokens))
                    if name == order[0]:
                        prompt_lens.append(len(ids))
                messages.append({"role": "assistant", "content": answer(llm, messages, args.answer_tokens)})
    return {"times": times, "prompt_tokens": statistics.mean(prompt_lens), "requests": len(prompt_lens)}


def system_prompt(engines: dict, args) -> dict:
    times = {name: {"all": []} for name in engines}
    prompt_lens = []
    for i, q in enumerate(QUESTIONS[: args.limit]):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            llm = engines[name]
            ids = chat_ids(llm, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}])
            times[name]["all"].append(ttft(llm, ids, args.tokens))
        prompt_lens.append(len(ids))
    # The first request fills the cache on the caching engine: report it apart.
    first = {name: t["all"].pop(0) for name, t in times.items()}
    return {"times": times, "first": first, "prompt_tokens": statistics.mean(prompt_lens), "requests": len(prompt_lens)}


def run(args, doc: dict) -> None:
    from specserve import LLM
    from specserve.bench.options import parse_configs

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if set(workloads) - set(WORKLOADS):
        raise ValueError(f"unknown workloads {sorted(set(workloads) - set(WORKLOADS))}: any of {', '.join(WORKLOADS)}")
    doc["params"] = {k: getattr(args, k) for k in ("model", "prompts", "limit", "answer_tokens", "workloads", "turns",
                                                    "max_model_len", "configs", "tokens")}
    configs = parse_configs(args.configs, add_plain=False)   # each is compared with itself, caching off
    kw = dict(model=args.model, max_model_len=args.max_model_len, kv_cache_memory=1 << 28)
    engines = {f"{c.name}/{mode}": LLM(**kw, speculative_config=c.speculative_config, enable_prefix_caching=on)
               for c in configs for mode, on in (("no-caching", False), ("caching", True))}
    runs = {"multi-turn": ("multi-turn chat: turn 2", multi_turn),
            "long-chat": (f"long chat: turns 2-{args.turns}", long_chat),
            "system-prompt": ("shared system prompt", system_prompt)}
    rows, samples = [], {}
    for w in workloads:
        title, fn = runs[w]
        result = fn(engines, args)
        samples[w] = result
        for c in configs:
            off = sum(result["times"][f"{c.name}/no-caching"].values(), [])
            on = sum(result["times"][f"{c.name}/caching"].values(), [])
            m_off, m_on = statistics.mean(off) * 1e3, statistics.mean(on) * 1e3
            rows.append([title, f"`{c.name}`", str(len(on)), fmt(result["prompt_tokens"], 0), fmt(m_off, 0),
                         fmt(m_on, 0), fmt(m_off / m_on, 2, "x")])   # requests: those averaged
    samples["prefix_cache_stats"] = {n: str(llm.engine.get_prefix_cache_stats()) for n, llm in engines.items()}
    timed = "TTFT" if args.tokens == 1 else f"time to {args.tokens} tokens"
    doc["table"] = {"columns": ["workload", "configuration", "requests", "mean prompt tokens",
                                f"{timed} without caching (ms)", f"{timed} with caching (ms)", "ratio"], "rows": rows}
    model_name = next(iter(engines.values())).engine.model_name
    doc["notes"] = [f"Model {model_name}; the engines alternate request by request; "
                    "shared system prompt: the first request (filling the cache) is left out."]
    doc["samples"] = samples
