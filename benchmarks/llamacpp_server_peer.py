"""Chat answers: specserve (plain and with speculation) against llama.cpp's llama-server, same GGUF file.

Each question's first turn (Spec-Bench's JSONL format, ``--prompts``; default
Spec-Bench's 480 questions, ``--limit-per-category`` of each category) is asked as
one chat message, greedy, with ``--max-tokens`` new tokens at most; answers end
at the end-of-sequence token (Spec-Bench's protocol). llama.cpp answers through
its own OpenAI-compatible ``llama-server`` (a peer measured from outside, built by
``../shared/peers/build-llamacpp.sh``), started here with the same threads;
specserve answers in-process through ``LLM.chat``. Question by question the
engines run in rotating order. Reported: tok/s of whole answers (completion
tokens over the request's wall time, prompt included) per category and overall,
and each specserve engine's ratio to llama.cpp.

    python benchmarks/llamacpp_server_peer.py --llama-bin ~/.cache/specserve-peers/llama.cpp/build/bin \\
        --limit-per-category 4 --max-tokens 256 --speculative-method ngram --num-speculative-tokens 5
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

from specserve.bench.peers import post_json, start_llama_server, stop_process

from spec_bench import SPEC_BENCH   # benchmarks/spec_bench.py (this script's folder is on sys.path)


def post(url: str, body: dict) -> dict:
    return post_json(url, body, timeout=900)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", required=True)
    p.add_argument("--model", default=None, help="a .gguf file or catalog name (default: the default model)")
    p.add_argument("--prompts", default=SPEC_BENCH)
    p.add_argument("--limit-per-category", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speculative-method", default="ngram")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from specserve import LLM, SamplingParams
    from specserve.model_executor.loader import default_model_path

    rows, per_cat = [], defaultdict(int)
    for line in open(args.prompts):
        row = json.loads(line)
        if per_cat[row["category"]] < args.limit_per_category:
            per_cat[row["category"]] += 1
            rows.append(row)
    kw = dict(model=args.model, max_model_len=4096, kv_cache_memory=1 << 28)
    engines = {"specserve plain": LLM(**kw),
               f"specserve {args.speculative_method}": LLM(**kw, speculative_config={
                   "method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens})}
    model_path = engines["specserve plain"].engine.hf_config._name_or_path if args.model else default_model_path()
    server, base = start_llama_server(os.path.join(os.path.expanduser(args.llama_bin), "llama-server"), model_path,
                                      args.threads, ctx_size=4096, slots=1, timeout_s=300)
    names = ["llama.cpp server"] + list(engines)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tokens, seconds = defaultdict(lambda: defaultdict(int)), defaultdict(lambda: defaultdict(float))
    answers = defaultdict(list)   # specserve engine -> token ids per question, in question order
    try:
        warm = [{"role": "user", "content": "Hi"}]
        post(base + "/v1/chat/completions", {"messages": warm, "max_tokens": 4, "temperature": 0})
        for llm in engines.values():
            llm.chat(warm, SamplingParams(temperature=0, max_tokens=4))
        for i, row in enumerate(rows):
            messages = [{"role": "user", "content": row["turns"][0]}]
            for name in names[i % len(names):] + names[: i % len(names)]:
                t = time.perf_counter()
                if name == "llama.cpp server":
                    out = post(base + "/v1/chat/completions", {"messages": messages, "max_tokens": args.max_tokens,
                                                              "temperature": 0, "cache_prompt": False})
                    n = out["usage"]["completion_tokens"]
                else:
                    ids = engines[name].chat(messages, params)[0].outputs[0].token_ids
                    answers[name].append(ids)
                    n = len(ids)
                dt = time.perf_counter() - t
                for key in (row["category"], "all"):
                    tokens[key][name] += n
                    seconds[key][name] += dt
    finally:
        stop_process(server)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.path.basename(model_path)}, {len(rows)} questions "
          f"({args.limit_per_category} per category), max_tokens={args.max_tokens}, greedy, answers end at EOS, "
          f"threads={args.threads}, {args.speculative_method} k={args.num_speculative_tokens}")
    print("| category | " + " | ".join(f"{n} tok/s" for n in names) + " | " +
          " | ".join(f"{n} / llama.cpp" for n in names[1:]) + " |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    for cat in list(per_cat) + ["all"]:
        rates = [tokens[cat][n] / seconds[cat][n] for n in names]
        print(f"| {cat} | " + " | ".join(f"{r:.1f}" for r in rates) + " | " +
              " | ".join(f"{r / rates[0]:.2f}x" for r in rates[1:]) + " |")
    plain, spec = answers[names[1]], answers[names[2]]
    print(f"\nGreedy {names[2]} answers identical to plain: {sum(a == b for a, b in zip(plain, spec))} of {len(plain)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
