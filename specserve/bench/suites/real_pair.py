"""A real target and draft side by side: specserve's configurations and llama.cpp's speculative decoding.

Every configuration answers the same chat prompts (``--prompts``, Spec-Bench's JSONL; default the
project's 20 coding prompts) at batch 1 with ``--max-tokens`` new tokens, prompt by prompt, in
rotating order. Reported per configuration: whole-answer tok/s (new tokens over the request's wall
time, prompt included), the ratio to specserve's plain decoding, mean acceptance length, and at
temperature 0 how many answers equal plain decoding's (same activations) token for token.

Configurations: ``plain``, ``draft:K`` (the draft model, k = K, its activations the engine's
default: int8, ``factory.draft_uses_int8_activations``), ``ngram:K``; suffixes ``+int8`` (the target with
int8 activations), ``+int8draft`` / ``+f32draft`` (the draft with int8 / float32 activations),
``+p2``/``+p3``/``+p4`` (the target's activations as int8 pieces), ``+q4_0`` ... ``+q8_0`` (the draft
requantized at load), ``+vN`` (the draft's LM head kept to the first N token ids, ``draft_vocab_size``;
``--draft-vocab-size`` sets it for every draft configuration without one). With llama.cpp's binaries (``--llama-bin``), ``llama-speculative-simple``
answers the same chat-formatted text with the same files, k, threads and max tokens (its own
encode + decode time, load excluded); ``--llama-server`` adds llama.cpp's plain decoding through
``llama-server``'s ``/completion`` (prompt cache off), timed by the request's wall time.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections import defaultdict

from specserve.bench.results import fmt
from specserve.bench.suites.llama_bench import DEFAULT_LLAMA_BIN

ACTIVATIONS = ("int8", "p2", "p3", "p4")


def add_arguments(p) -> None:
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--configs", default="plain,draft:3,draft:4,ngram:4",
                   help="comma list: plain, draft:K, ngram:K, each with suffixes +int8 (the target's int8 "
                        "activations), +dynamic (dynamic_k up to K), +int8draft, +f32draft, +p2..+p4, +q4_0..+q8_0, "
                        "+vN (draft_vocab_size N)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the draft's LM head kept to the first N token ids, where a configuration has no +vN")
    p.add_argument("--prompts", default="coding", help="Spec-Bench-format JSONL ('coding': the project's 20)")
    p.add_argument("--categories", default=None)
    p.add_argument("--limit", type=int, default=8, help="at most N prompts per category")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN, help="llama.cpp's binaries ('none': specserve only)")
    p.add_argument("--llama-k", type=int, default=4, help="llama-speculative-simple's draft tokens per step")
    p.add_argument("--llama-server", action="store_true", help="also llama.cpp plain decoding through llama-server")


def build(config: str, args):
    from specserve import LLM
    from specserve.config import SpeculativeConfig

    config, *variants = config.split("+")
    quantization = [v for v in variants if v in SpeculativeConfig.DRAFT_QUANTIZATIONS]
    pieces = [int(v[1:]) for v in variants if v in ("p2", "p3", "p4")]
    vocab = [v for v in variants if re.fullmatch(r"v[1-9]\d*", v)]
    unknown = set(variants) - {"int8", "int8draft", "f32draft", "dynamic", "p2", "p3", "p4", *quantization, *vocab}
    if unknown or len(quantization) > 1 or len(vocab) > 1 or {"int8draft", "f32draft"} <= set(variants):
        raise ValueError(f"unknown or clashing configuration suffixes {sorted(unknown) or variants} (+int8, "
                         "+int8draft or +f32draft, +dynamic, +p2 ... +p4, one draft format +q4_0 ... +q8_0, "
                         "one draft vocabulary +vN)")
    draft_int8 = True if "int8draft" in variants else False if "f32draft" in variants else None
    kw = dict(model=args.target, max_model_len=2048, kv_cache_memory=1 << 28,
              int8_activations=pieces[0] if pieces else "int8" in variants)
    if config == "plain":
        return LLM(**kw)
    method, k = config.split(":")
    if method == "draft":
        spec = {"model": args.draft, "num_speculative_tokens": int(k),
                "draft_vocab_size": int(vocab[0][1:]) if vocab else args.draft_vocab_size,
                "draft_int8_activations": draft_int8,
                "draft_quantization": quantization[0] if quantization else None}
    elif method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": int(k)}
    else:
        raise ValueError(f"unknown configuration {config!r} (plain, draft:K, ngram:K)")
    if "dynamic" in variants:   # k chosen each step from measured costs, up to K (dynamic_k)
        spec["dynamic_k"] = True
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
    out = post_json(base + "/completion", {"prompt": text, "n_predict": args.max_tokens,
                                           "temperature": args.temperature, "seed": 0, "cache_prompt": False},
                    timeout=900)
    return out["tokens_predicted"], time.perf_counter() - t


def run(args, doc: dict) -> None:
    import torch

    from specserve import SamplingParams
    from specserve.bench.options import load_prompts
    from specserve.bench.peers import start_llama_server, stop_process
    from specserve.model_executor.loader import load_model

    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = load_prompts(args.prompts, cats, args.limit)
    configs = args.configs.split(",")
    doc["params"] = {k: getattr(args, k) for k in ("target", "draft", "configs", "draft_vocab_size", "prompts",
                                                    "categories", "limit", "max_tokens", "temperature", "threads",
                                                    "llama_k", "llama_server")}
    engines = {c: build(c, args) for c in configs}
    tokenizer = engines[configs[0]].get_tokenizer()
    args.target_path = engines[configs[0]].engine.hf_config._name_or_path
    args.draft_path = load_model(args.draft, torch.float32, load_weights=False).source
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    for llm in engines.values():   # warm-up: kernels built, weights paged in
        llm.generate("def f(", SamplingParams(temperature=0, max_tokens=4))
    use_llama = args.llama_bin != "none"
    names = configs + (["llama.cpp spec"] if use_llama else [])
    server = base = None
    if use_llama and args.llama_server:
        server, base = start_llama_server(os.path.join(os.path.expanduser(args.llama_bin), "llama-server"),
                                          args.target_path, args.threads, ctx_size=2048, slots=1, timeout_s=300)
        llama_plain(base, args, "def f(")   # warm-up
        names.append("llama.cpp plain")
    samples = []
    try:
        for i, q in enumerate(prompts):
            text = tokenizer.apply_chat_template([{"role": "user", "content": q.text}], tokenize=False,
                                                 add_generation_prompt=True)
            for name in names[i % len(names):] + names[: i % len(names)]:
                s = {"question_id": q.question_id, "category": q.category, "config": name, "tau": None, "ids": None}
                if name == "llama.cpp spec":
                    s["tokens"], s["seconds"], s["tau"] = llama_spec(args, text)   # llama.cpp: acceptance rate
                elif name == "llama.cpp plain":
                    s["tokens"], s["seconds"] = llama_plain(base, args, text)
                else:
                    t = time.perf_counter()
                    out = engines[name].generate(text, params)[0]
                    s["seconds"], s["ids"] = time.perf_counter() - t, list(out.outputs[0].token_ids)
                    s["tokens"] = len(s["ids"])
                    st = out.spec_decode_stats
                    if st is not None and st.num_steps:
                        s["tau"] = st.mean_acceptance_length
                samples.append(s)
    finally:
        if server is not None:
            stop_process(server)
    tok, sec, taus, answers = defaultdict(int), defaultdict(float), defaultdict(list), defaultdict(list)
    for s in samples:
        tok[s["config"]] += s["tokens"]
        sec[s["config"]] += s["seconds"]
        if s["tau"] is not None:
            taus[s["config"]].append(s["tau"])
        if s["ids"] is not None:
            answers[s["config"]].append(s["ids"])
    base_rate = tok["plain"] / sec["plain"] if "plain" in tok else None
    rows = []
    for name in names:
        rate = tok[name] / sec[name]
        suffixes = name.split("+")[1:]
        plain = "+".join(["plain"] + [v for v in suffixes if v in ACTIVATIONS])
        same = (f"{sum(a == b for a, b in zip(answers[name], answers[plain]))}/{len(prompts)}"
                if args.temperature == 0 and name != plain and plain in answers and name in answers else "—")
        tau = sum(taus[name]) / len(taus[name]) if taus[name] else None
        rows.append([f"`{name}`", fmt(rate, 2), fmt(rate / base_rate, 2, "x") if base_rate else "—",
                     fmt(tau, 2), same])
    doc["table"] = {"columns": ["configuration", "tok/s (whole answers)", "vs specserve plain",
                                "tau (llama.cpp spec: acceptance rate)", "greedy == plain"], "rows": rows}
    doc["notes"] = [f"{args.target} with draft {args.draft}, {len(prompts)} prompts, batch 1, {args.max_tokens} "
                    f"tokens at most, temperature {args.temperature:g}, {args.threads} threads; llama.cpp k = "
                    f"{args.llama_k}."]
    for s in samples:
        s.pop("ids")
    doc["samples"] = samples
