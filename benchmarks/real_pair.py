"""A real target and draft side by side: specserve's configurations and llama.cpp's speculative decoding.

Every configuration answers the same chat prompts (``--prompts``, Spec-Bench's JSONL
format; default ``prompts/coding.jsonl``, the project's own 20 coding prompts) at
batch 1 with ``--max-tokens`` new tokens, prompt by prompt, the configurations in
rotating order (a noisy machine slows all of them alike). Reported per configuration:
whole-answer tok/s (new tokens over the wall time of the request, prompt included),
the ratio to specserve's plain decoding, and mean acceptance length; at temperature 0,
how many answers of each configuration equal plain decoding's with the same
activations (``plain`` or ``plain+int8``) token for token.

specserve configurations: ``plain``, ``draft:K`` (the draft model, k = K; with
``--draft-vocab-size N`` its LM head keeps the first N tokens), ``ngram:K``; a
``+int8`` suffix (``plain+int8``, ``draft:3+int8``) runs target and draft with
``int8_activations=True``; ``+f32draft`` runs the draft with float32 activations
(``draft_int8_activations=False``; by default the draft uses int8 activations); ``+p3``
(``+p2``, ``+p4``) runs the target with ``int8_activations=3``, its activations as three
int8 pieces (float32's precision, ``cpu_kernels/q8_act.h``; on CPUs with AMX, ``+p3`` runs
on int8 tiles, ``cpu_kernels/amx_int8.h``, and ``+vnni`` keeps the target off the tiles,
``SPECSERVE_CPU_AMX=off``); a
``+q4_1`` (or ``+q4_0``, ``+q5_0``, ``+q5_1``, ``+q8_0``) suffix requantizes the draft
to that format at load (``draft_quantization``). Suffixes combine: ``draft:3+int8+q4_1``.
With ``--llama-bin``, llama.cpp's own ``llama-speculative-simple`` (a peer measured
from outside, built by ``../shared/peers/build-llamacpp.sh``) answers the same
chat-formatted prompts with the same files, k, threads and max tokens; its whole
answer time is its own "encoded" plus "decoded" times (its model load excluded).
With ``--llama-server`` too, llama.cpp's plain decoding answers the same text through
its ``llama-server`` (``/completion``, prompt cache off, same sampling settings and
seed), timed by the request's wall time like specserve's answers.

    python benchmarks/real_pair.py --configs plain,draft:3,draft:4,ngram:4 --draft-vocab-size 32768 \\
        --llama-bin ~/.cache/specserve-peers/llama.cpp/build/bin --llama-k 4 --max-tokens 64 --limit 8
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from forward_timing import with_amx  # noqa: E402  (SPECSERVE_CPU_AMX set and restored around a build)


def load_prompts(path: str, categories: str | None, limit: int | None, per_category: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if categories:
        keep = set(categories.split(","))
        rows = [r for r in rows if r["category"] in keep]
    if per_category:   # the first N questions of each category
        counts: dict[str, int] = {}
        kept = []
        for r in rows:
            counts[r["category"]] = counts.get(r["category"], 0) + 1
            if counts[r["category"]] <= per_category:
                kept.append(r)
        rows = kept
    return rows[:limit] if limit else rows


def build(config: str, args):
    from specserve.config import SpeculativeConfig

    config, *variants = config.split("+")
    quantization = [v for v in variants if v in SpeculativeConfig.DRAFT_QUANTIZATIONS]
    pieces = [int(v[1:]) for v in variants if v in ("p2", "p3", "p4")]
    unknown = set(variants) - {"int8", "f32draft", "p2", "p3", "p4", "vnni", *quantization}
    if unknown or len(quantization) > 1:
        raise SystemExit(f"unknown configuration suffixes {sorted(unknown) or quantization} "
                         "(+int8, +f32draft, +p2 ... +p4, +vnni, one draft format +q4_0 ... +q8_0)")
    kw = dict(model=args.target, max_model_len=2048, kv_cache_memory=1 << 28, int8_activations=pieces[0] if pieces else "int8" in variants)
    if "vnni" in variants:   # the AMX kernels off while the matrices are packed, at the end of loading
        return with_amx(False, lambda: build_llm(config, variants, quantization, kw, args))
    return build_llm(config, variants, quantization, kw, args)


def build_llm(config: str, variants: list[str], quantization: list[str], kw: dict, args):
    from specserve import LLM

    if config == "plain":
        return LLM(**kw)
    method, k = config.split(":")
    if method == "draft":
        spec = {"model": args.draft, "num_speculative_tokens": int(k), "draft_vocab_size": args.draft_vocab_size,
                "draft_int8_activations": "f32draft" not in variants,
                "draft_quantization": quantization[0] if quantization else None}
    elif method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": int(k)}
    else:
        raise SystemExit(f"unknown configuration {config!r}")
    return LLM(**kw, speculative_config=spec)


def llama_spec(args, text: str) -> tuple[int, float, float]:
    """(new tokens, seconds for prompt + answer, acceptance) from llama-speculative-simple."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        out = subprocess.run(
            [os.path.join(os.path.expanduser(args.llama_bin), "llama-speculative-simple"), "-m", args.target_path,
             "-md", args.draft_path, "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.llama_k),
             "-f", f.name, "-n", str(args.max_tokens), "--temp", str(args.temperature), "-t", str(args.threads),
             "-td", str(args.threads), "-c", "2048", "--seed", "0"],
            capture_output=True, text=True, timeout=900).stderr
    finally:
        os.unlink(f.name)
    enc = float(re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", out).group(1))
    dec_tokens, dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out).groups()
    accept = re.search(r"accept\s+=\s+([\d.]+)%", out)
    return int(dec_tokens), enc + float(dec), float(accept.group(1)) / 100 if accept else float("nan")


def llama_plain(base: str, args, text: str) -> tuple[int, float]:
    """(new tokens, seconds of the request) for llama-server's plain answer to the same prompt text."""
    from specserve.bench.peers import post_json
    t = time.perf_counter()
    out = post_json(base + "/completion", {"prompt": text, "n_predict": args.max_tokens, "temperature": args.temperature,
                                           "seed": 0, "cache_prompt": False}, timeout=900)
    return out["tokens_predicted"], time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--configs", default="plain,draft:3,draft:4,ngram:4")
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--prompts", default=os.path.join(HERE, "prompts", "coding.jsonl"))
    p.add_argument("--categories", default=None)
    p.add_argument("--per-category", type=int, default=None, help="the first N prompts of each category")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-bin", default=None)
    p.add_argument("--llama-k", type=int, default=4)
    p.add_argument("--llama-server", action="store_true", help="also llama.cpp plain decoding through llama-server")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from specserve import SamplingParams

    prompts = load_prompts(args.prompts, args.categories, args.limit, args.per_category)
    configs = args.configs.split(",")
    engines = {c: build(c, args) for c in configs}
    tokenizer = engines[configs[0]].get_tokenizer()
    args.target_path = engines[configs[0]].engine.hf_config._name_or_path
    from specserve.model_executor.loader import load_model
    args.draft_path = load_model(args.draft, torch.float32, load_weights=False).source
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    for llm in engines.values():   # warm-up: kernels built, weights paged in
        llm.generate("def f(", SamplingParams(temperature=0, max_tokens=4))
    tokens, seconds, taus, answers = defaultdict(int), defaultdict(float), defaultdict(list), defaultdict(list)
    by_cat = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    names = configs + (["llama.cpp spec"] if args.llama_bin else [])
    server = None
    if args.llama_bin and args.llama_server:
        from specserve.bench.peers import start_llama_server
        server, base_url = start_llama_server(os.path.join(os.path.expanduser(args.llama_bin), "llama-server"),
                                              args.target_path, args.threads, ctx_size=2048, slots=1, timeout_s=300)
        llama_plain(base_url, args, "def f(")   # warm-up
        names.append("llama.cpp plain")
    try:
        measure(prompts, names, engines, tokenizer, args, params, tokens, seconds, taus, answers, by_cat,
                base_url if server else None)
    finally:
        if server is not None:
            from specserve.bench.peers import stop_process
            stop_process(server)
    report(prompts, names, configs, args, tokens, seconds, taus, answers, by_cat)
    return 0


def measure(prompts, names, engines, tokenizer, args, params, tokens, seconds, taus, answers, by_cat, base_url):
    """Every prompt through every configuration, in rotating order; sums into the dicts passed in."""
    for i, row in enumerate(prompts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}], tokenize=False,
                                             add_generation_prompt=True)
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            if name == "llama.cpp spec":
                n, dt, acc = llama_spec(args, text)
                taus[name].append(acc)
            elif name == "llama.cpp plain":
                n, dt = llama_plain(base_url, args, text)
            else:
                llm = engines[name]
                t = time.perf_counter()
                out = llm.generate(text, params)[0]
                dt, n = time.perf_counter() - t, len(out.outputs[0].token_ids)
                answers[name].append(list(out.outputs[0].token_ids))
                if out.spec_decode_stats is not None and out.spec_decode_stats.num_steps:
                    taus[name].append(out.spec_decode_stats.mean_acceptance_length)
            tokens[name] += n
            seconds[name] += dt
            by_cat[row["category"]][name][0] += n
            by_cat[row["category"]][name][1] += dt


def report(prompts, names, configs, args, tokens, seconds, taus, answers, by_cat) -> None:
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {args.target} / {args.draft}, {len(prompts)} prompts of "
          f"{os.path.basename(args.prompts)}, max_tokens={args.max_tokens}, temperature={args.temperature}, "
          f"threads={args.threads}, draft_vocab_size={args.draft_vocab_size}, llama k={args.llama_k}")
    base = tokens["plain"] / seconds["plain"] if "plain" in tokens else None   # ratios against float32-activation plain
    print("| configuration | tok/s (whole answers) | vs specserve plain | mean acceptance length (llama.cpp: acceptance) |")
    print("|---|---|---|---|")
    for name in names:
        rate = tokens[name] / seconds[name]
        tau = sum(taus[name]) / len(taus[name]) if taus[name] else float("nan")
        print(f"| {name} | {rate:.2f} | {rate / base:.2f}x | {tau:.2f} |" if base else f"| {name} | {rate:.2f} | | {tau:.2f} |")
    print("\nPer category, tok/s:\n")
    print("| category | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for cat, per in by_cat.items():
        print(f"| {cat} | " + " | ".join(f"{per[n][0] / per[n][1]:.2f}" for n in names) + " |")
    if args.temperature == 0:   # lossless: each configuration against plain decoding with the same activations
        print()
        for name in configs:
            suffixes = name.split("+")[1:]
            plain = "+".join(["plain"] + [v for v in suffixes if v in ("int8", "p2", "p3", "p4", "vnni")])
            if name != plain and plain in answers:
                same = sum(a == b for a, b in zip(answers[name], answers[plain]))
                print(f"greedy answers of {name} equal to {plain}'s: {same} of {len(prompts)}")


if __name__ == "__main__":
    sys.exit(main())
