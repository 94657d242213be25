"""Chat answers: specserve (plain and with speculation) against llama.cpp's ``llama-server``, same GGUF file.

Each question's first turn (Spec-Bench's JSONL, ``--limit`` per category) is asked as one chat
message, greedy, at most ``--max-tokens`` new tokens, answers ending at end-of-sequence
(Spec-Bench's protocol). llama.cpp answers through its own OpenAI-compatible server (a peer measured
from outside, started here with the same threads, prompt cache off); specserve answers in-process
through ``LLM.chat``. Question by question the engines run in rotating order. Reported: tok/s per
category (new tokens over wall time, prefill included) and the ratios to llama.cpp. With ``--lora
FILE`` (llama.cpp's LoRA .gguf, as its convert_lora_to_gguf.py writes) every engine answers with that
adapter: llama-server started with ``--lora FILE``, specserve with ``LoRARequest`` on the same file.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict

from specserve.bench.results import fmt
from specserve.bench.suites.llama_bench import DEFAULT_LLAMA_BIN

SERVER = "llama.cpp server"


def add_arguments(p) -> None:
    p.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN, help="folder with llama.cpp's llama-server")
    p.add_argument("--model", default=None, help="a .gguf file or catalog name (default: the default model)")
    p.add_argument("--prompts", default="spec-bench", help="Spec-Bench-format JSONL ('spec-bench': the shared copy)")
    p.add_argument("--limit", type=int, default=4, help="questions per category")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speculative-method", default="ngram")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--lora", default=None, metavar="FILE",
                   help="a llama.cpp LoRA adapter (.gguf) every engine answers with")


def run(args, doc: dict) -> None:
    from specserve import LLM, LoRARequest, SamplingParams
    from specserve.bench.options import load_prompts
    from specserve.bench.peers import post_json, start_llama_server, stop_process
    from specserve.model_executor.loader import default_model_path

    if args.suite == "lora" and not args.lora:
        raise SystemExit("specserve bench lora: --lora ADAPTER.gguf is needed (benchmarks/lora_demo.py writes one)")
    prompts = load_prompts(args.prompts, None, args.limit)
    doc["params"] = {k: getattr(args, k) for k in ("model", "prompts", "limit", "max_tokens", "threads",
                                                    "speculative_method", "num_speculative_tokens", "lora")}
    kw = dict(model=args.model, max_model_len=4096, kv_cache_memory=1 << 28, enable_lora=bool(args.lora))
    lora = LoRARequest("lora", 1, os.path.abspath(args.lora)) if args.lora else None
    spec_name = f"specserve {args.speculative_method}"
    engines = {"specserve plain": LLM(**kw),
               spec_name: LLM(**kw, speculative_config={"method": args.speculative_method,
                                                        "num_speculative_tokens": args.num_speculative_tokens})}
    model_path = engines["specserve plain"].engine.hf_config._name_or_path if args.model else default_model_path()
    server, base = start_llama_server(os.path.join(os.path.expanduser(args.llama_bin), "llama-server"), model_path,
                                      args.threads, ctx_size=4096, slots=1, timeout_s=300,
                                      extra_args=["--lora", os.path.abspath(args.lora)] if args.lora else ())
    names = [SERVER] + list(engines)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    samples = []
    answers = defaultdict(list)   # specserve engine -> token ids per question, in question order
    try:
        warm = [{"role": "user", "content": "Hi"}]
        post_json(base + "/v1/chat/completions", {"messages": warm, "max_tokens": 4, "temperature": 0}, timeout=900)
        for llm in engines.values():
            llm.chat(warm, SamplingParams(temperature=0, max_tokens=4), lora_request=lora)
        for i, q in enumerate(prompts):
            messages = [{"role": "user", "content": q.text}]
            for name in names[i % len(names):] + names[: i % len(names)]:
                t = time.perf_counter()
                if name == SERVER:
                    out = post_json(base + "/v1/chat/completions",
                                    {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                                     "cache_prompt": False}, timeout=900)
                    n = out["usage"]["completion_tokens"]
                else:
                    ids = engines[name].chat(messages, params, lora_request=lora)[0].outputs[0].token_ids
                    answers[name].append(ids)
                    n = len(ids)
                samples.append({"question_id": q.question_id, "category": q.category, "engine": name,
                                "tokens": n, "seconds": time.perf_counter() - t})
    finally:
        stop_process(server)
    tokens, seconds = defaultdict(lambda: defaultdict(int)), defaultdict(lambda: defaultdict(float))
    for s in samples:
        for key in (s["category"], "all"):
            tokens[key][s["engine"]] += s["tokens"]
            seconds[key][s["engine"]] += s["seconds"]
    cats = list(dict.fromkeys(q.category for q in prompts)) + ["all"]
    rows = []
    for cat in cats:
        rates = [tokens[cat][n] / seconds[cat][n] for n in names]
        rows.append([f"**{cat}**" if cat == "all" else cat] + [fmt(r) for r in rates]
                    + [fmt(r / rates[0], 2, "x") for r in rates[1:]])
    same = sum(a == b for a, b in zip(answers["specserve plain"], answers[spec_name]))
    doc["table"] = {"columns": ["category"] + [f"{n} tok/s" for n in names] + [f"{n} / llama.cpp" for n in names[1:]],
                    "rows": rows}
    doc["notes"] = [f"{os.path.basename(model_path)}, {len(prompts)} questions ({args.limit} per category), greedy, "
                    f"at most {args.max_tokens} tokens, answers end at end-of-sequence, {args.threads} threads; "
                    f"{args.speculative_method} k={args.num_speculative_tokens}"
                    + (f"; every answer with the LoRA adapter {os.path.basename(args.lora)}." if args.lora else "."),
                    f"Greedy {spec_name} answers identical to plain: {same} of {len(answers[spec_name])}."]
    doc["samples"] = samples
