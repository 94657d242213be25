"""Plain decoding and prompt processing: specserve against llama.cpp's ``llama-bench`` on the same GGUF
file and threads.

llama.cpp is a peer measured from outside (its own ``llama-bench``, built by
``../shared/peers/build-llamacpp.sh``), never imported. Each round runs ``llama-bench -p 0 -n N``
(N tokens decoded after an empty prompt, its own timer), then specserve decoding N tokens after a
one-token prompt at batch 1, greedy, timed after the first token (prefill counted on neither side);
rounds rotate who goes first, so a noisy machine slows both alike. Reported: each engine's median
decode tok/s, the ratio, specserve's load time, resident memory after load and peak memory.
With ``--prompt-tokens P`` (512, llama-bench's own default; 0 skips it) each round also times a
P-token prompt: ``llama-bench -p P -n 0`` against specserve's prefill of P random token ids (new
ones each round, so the prefix cache never helps) up to its first token, as prompt tok/s.
``--int8-activations off,on`` (or piece counts 2-4) measures specserve's activation variants in the
same rounds.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

from specserve.bench.options import int8_activations_label, parse_int8_activations
from specserve.bench.results import fmt

DEFAULT_LLAMA_BIN = "~/.cache/specserve-peers/llama.cpp/build/bin"


def add_arguments(p) -> None:
    p.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN, help="folder with llama.cpp's llama-bench")
    p.add_argument("--models", default="default", help="comma-separated .gguf paths or catalog names ('default')")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per round")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="also time a prompt of this many tokens (prompt processing); 0: decoding only")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="threads of both engines")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--int8-activations", default="off",
                   help="comma list of off, on and piece counts 2-4 (e.g. off,on,3): one specserve engine each")


def proc_status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def llama_bench(binary: str, model: str, tokens: int, threads: int, prompt_tokens: int = 0) -> float:
    """llama.cpp's own tok/s, one repetition: decoding ``tokens`` (tg test), or with ``prompt_tokens``
    a prompt of that many tokens in one batch (pp test)."""
    p, n = (prompt_tokens, 0) if prompt_tokens else (0, tokens)
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", str(p), "-n", str(n), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def specserve_decode(llm, tokens: int) -> float:
    """specserve's decode tok/s: N greedy tokens after a one-token prompt, timed after the first."""
    from specserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    engine.add_request([engine.tokenizer.bos_token_id or 1], params)
    produced, start, first = 0, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced = len(out.outputs[0].token_ids)
        if start is None and produced >= 1:
            start, first = time.perf_counter(), produced
    return (produced - first) / (time.perf_counter() - start)


def specserve_prefill(llm, tokens: int, seed: int) -> float:
    """specserve's prompt tok/s: a prompt of ``tokens`` random ids drawn from ``seed`` (>= 0; a new
    seed gives a new prompt) from its arrival to its first token. Raises RuntimeError when any of
    it came from the prefix cache (a seed used before), which would time a cache hit."""
    import random

    from specserve import SamplingParams

    if seed < 0:   # random.Random(-s) draws what random.Random(s) does
        raise ValueError(f"seed must be >= 0, got {seed}")
    engine = llm.engine
    ids = random.Random(seed).choices(range(engine.vocab_size), k=tokens)
    hits = engine.get_prefix_cache_stats()["hits"]
    start = time.perf_counter()
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    if engine.get_prefix_cache_stats()["hits"] != hits:
        raise RuntimeError(f"the prompt of seed {seed} was found in the prefix cache: its prefill was not timed")
    return tokens / elapsed


def _variants(spec: str) -> list:
    return [parse_int8_activations(item) for item in spec.split(",")]


def _label(v) -> str:
    return " ".join(filter(None, ["specserve", int8_activations_label(v)]))


def run(args, doc: dict) -> None:
    from specserve import LLM
    from specserve.model_executor.loader import default_model_path

    bench = os.path.join(os.path.expanduser(args.llama_bin), "llama-bench")
    if not os.path.exists(bench):
        raise ValueError(f"no llama-bench in {args.llama_bin}: build it with ../shared/peers/build-llamacpp.sh")
    variants = _variants(args.int8_activations)
    pp = args.prompt_tokens
    doc["params"] = {"models": args.models, "tokens": args.tokens, "prompt_tokens": pp, "rounds": args.rounds,
                     "threads": args.threads, "dtype": args.dtype, "int8_activations": variants}
    cols = ["model", "llama.cpp decode tok/s"]
    for v in variants:
        cols += [f"{_label(v)} decode tok/s", f"{_label(v)} / llama.cpp"]
    if pp:
        cols += [f"llama.cpp prompt tok/s ({pp} tokens)"]
        for v in variants:
            cols += [f"{_label(v)} prompt tok/s", f"{_label(v)} prompt / llama.cpp"]
    cols += ["specserve load s", "RSS after load MiB", "peak RSS MiB", "file MiB"]
    rows, samples = [], []
    for name in args.models.split(","):
        rss0 = proc_status("VmRSS")
        llms, load_s = {}, 0.0
        for v in variants:
            t0 = time.perf_counter()
            llms[v] = LLM(model=None if name == "default" else name, dtype=args.dtype, max_model_len=1024,
                          kv_cache_memory=1 << 27, int8_activations=v)
            load_s = load_s or time.perf_counter() - t0
        path = default_model_path() if name == "default" else llms[variants[0]].engine.runner.config._name_or_path
        rss, peak = proc_status("VmRSS") - rss0, proc_status("VmHWM")
        for llm in llms.values():
            specserve_decode(llm, 8)   # warm-up: kernels built, weights paged in
        if pp:
            for llm in llms.values():
                specserve_prefill(llm, pp, seed=args.rounds)   # warm-up at the prompt's shape (rounds take 0..)
        ours = {v: [] for v in variants}
        ours_pp = {v: [] for v in variants}
        theirs, theirs_pp = [], []
        who_all = ["llama"] + variants
        for r in range(args.rounds):
            for who in who_all[r % len(who_all):] + who_all[: r % len(who_all)]:   # rotate who goes first
                if who == "llama":
                    theirs.append(llama_bench(bench, path, args.tokens, args.threads))
                    if pp:
                        theirs_pp.append(llama_bench(bench, path, args.tokens, args.threads, prompt_tokens=pp))
                else:
                    ours[who].append(specserve_decode(llms[who], args.tokens))
                    if pp:
                        ours_pp[who].append(specserve_prefill(llms[who], pp, seed=r))
        a = statistics.median(theirs)
        row = [os.path.basename(path), fmt(a)]
        for v in variants:
            b = statistics.median(ours[v])
            row += [fmt(b), fmt(b / a, 2, "x")]
        if pp:
            a_pp = statistics.median(theirs_pp)
            row += [fmt(a_pp)]
            for v in variants:
                b = statistics.median(ours_pp[v])
                row += [fmt(b), fmt(b / a_pp, 2, "x")]
        row += [fmt(load_s), fmt(rss / 2**20, 0), fmt(peak / 2**20, 0), fmt(os.path.getsize(path) / 2**20, 0)]
        rows.append(row)
        samples.append({"model": path, "llama_cpp_tok_s": theirs, "specserve_tok_s": {_label(v): ours[v] for v in variants},
                        "llama_cpp_prompt_tok_s": theirs_pp,
                        "specserve_prompt_tok_s": {_label(v): ours_pp[v] for v in variants},
                        "load_s": load_s, "rss_bytes": rss, "peak_rss_bytes": peak})
        del llms
    doc["table"] = {"columns": cols, "rows": rows}
    doc["notes"] = [f"Decode tok/s: {args.tokens} greedy tokens at batch 1 after a one-token prompt, prefill not "
                    f"counted; median of {args.rounds} rounds, engines alternated; {args.threads} threads each."]
    if pp:
        doc["notes"].append(f"Prompt tok/s: a {pp}-token prompt of random token ids, llama-bench's pp test against "
                            "specserve's prefill up to the first token (a new prompt each round: no prefix-cache hit).")
    doc["samples"] = samples
