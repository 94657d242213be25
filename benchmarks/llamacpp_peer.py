"""Plain decoding: specserve against llama.cpp on the same GGUF file, same threads, interleaved.

llama.cpp is a peer measured from outside (its own ``llama-bench``, built by
``../shared/peers/build-llamacpp.sh``), never imported by specserve. Each round runs
``llama-bench -p 0 -n N`` (N tokens decoded after an empty prompt, its own timer),
then specserve decoding N tokens after a one-token prompt at batch 1, greedy (the
time after the first token, so prefill is not counted on either side); rounds
alternate which engine goes first, so a noisy machine slows both alike. Reported:
each engine's median decode tok/s, the ratio, and specserve's load time, resident
memory after load and peak memory while loading (``VmRSS``, ``VmHWM``).

    python benchmarks/llamacpp_peer.py --llama-bin ~/.cache/specserve-peers/llama.cpp/build/bin \\
        --models default,/path/to/qwen2.5-coder-1.5b-instruct.gguf --tokens 128 --rounds 3

``--dtype float16`` runs specserve's previous path (weights dequantized to float16
at load) for comparison; the default ``auto`` keeps the file's blocks.
``--int8-activations both`` measures specserve with float32 activations and with
``int8_activations=True`` (VNNI byte products, ``cpu_kernels/q8_act.h``) in the same
rounds: ``on`` or ``off`` measures one of them. A comma list may add piece counts:
``--int8-activations off,3`` measures float32 activations against three int8 pieces
(``int8_activations=3``, float32's precision; ``cpu_kernels/q8_act.h``, or on CPUs with AMX
the int8 tiles of ``cpu_kernels/amx_int8.h``).

``--native-llama-bin DIR`` adds a second llama.cpp build's ``llama-bench`` to every round (a
``-DGGML_NATIVE=ON`` build: ``-march=native``, with AMX where the CPU has it), reported beside
the first. On the development VMs such a build decodes but dies with "Illegal instruction" on
prompts of more than one token, which is why the ratio is taken against the portable build of
``build-llamacpp.sh``; the native figure shows what this CPU's best llama.cpp decoding is.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def proc_status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def llama_bench(binary: str, model: str, tokens: int, threads: int) -> float:
    """llama.cpp's own decode tok/s (tg test, one repetition)."""
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def specserve_decode(llm, tokens: int) -> float:
    """specserve's decode tok/s: N greedy tokens after a one-token prompt, timed after the first."""
    from specserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    engine.add_request([engine.tokenizer.bos_token_id or 1], params)
    produced, start = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced = len(out.outputs[0].token_ids)
        if start is None and produced >= 1:
            start, first = time.perf_counter(), produced
    return (produced - first) / (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", required=True, help="folder with llama.cpp's llama-bench")
    p.add_argument("--native-llama-bin", default=None,
                   help="folder with a -march=native llama.cpp build's llama-bench, measured beside")
    p.add_argument("--models", default="default", help="comma-separated .gguf paths or catalog names ('default')")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--int8-activations", default="off",
                   help="off, on, both, or a comma list of those and piece counts 2-4 (e.g. off,on,3)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from specserve import LLM
    from specserve.model_executor.loader import default_model_path

    bench = os.path.join(os.path.expanduser(args.llama_bin), "llama-bench")
    native = os.path.join(os.path.expanduser(args.native_llama_bin), "llama-bench") if args.native_llama_bin else None
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} threads={args.threads} tokens={args.tokens} dtype={args.dtype} "
          f"torch={torch.__version__}")
    variants = []
    for item in args.int8_activations.split(","):
        variants += {"off": [False], "on": [True], "both": [False, True]}.get(item) or [int(item)]
    label = {v: {False: "specserve", True: "specserve int8 act."}.get(v, f"specserve {v} int8 pieces")
             for v in variants}
    head = " | ".join(f"{label[v]} decode tok/s | {label[v]} / llama.cpp" for v in variants)
    native_head = " | llama.cpp native build decode tok/s" if native else ""
    print(f"| model | llama.cpp decode tok/s | {head}{native_head} | specserve load s | RSS after load MiB | "
          "peak RSS MiB | file MiB |")
    print("|---|---|" + "---|---|" * len(variants) + ("---|" if native else "") + "---|---|---|---|")
    for name in args.models.split(","):
        rss0 = proc_status("VmRSS")
        llms, load_s = {}, 0.0
        for v in variants:
            t0 = time.perf_counter()
            llms[v] = LLM(model=None if name == "default" else name, dtype=args.dtype, max_model_len=1024,
                          kv_cache_memory=1 << 27, int8_activations=v)
            load_s = load_s or time.perf_counter() - t0
        first = llms[variants[0]]
        path = first.engine.runner.config._name_or_path if name != "default" else default_model_path()
        rss, peak = proc_status("VmRSS") - rss0, proc_status("VmHWM")
        for llm in llms.values():
            specserve_decode(llm, 8)   # warm-up: kernels built, weights paged in
        ours: dict[bool, list[float]] = {v: [] for v in variants}
        theirs, native_rates = [], []
        who_all = ["llama"] + (["native"] if native else []) + variants
        for r in range(args.rounds):
            order = who_all[r % len(who_all):] + who_all[: r % len(who_all)]   # rotate who goes first
            for who in order:
                if who == "llama":
                    theirs.append(llama_bench(bench, path, args.tokens, args.threads))
                elif who == "native":
                    native_rates.append(llama_bench(native, path, args.tokens, args.threads))
                else:
                    ours[who].append(specserve_decode(llms[who], args.tokens))
        a = statistics.median(theirs)
        cells = []
        for v in variants:
            b = statistics.median(ours[v])
            cells.append(f"{b:.1f} ({', '.join(f'{x:.1f}' for x in ours[v])}) | {b / a:.2f}x")
        if native:
            cells.append(f"{statistics.median(native_rates):.1f} ({', '.join(f'{x:.1f}' for x in native_rates)})")
        print(f"| {os.path.basename(path)} | {a:.1f} ({', '.join(f'{x:.1f}' for x in theirs)}) | {' | '.join(cells)} | "
              f"{load_s:.1f} | {rss / 2**20:.0f} | {peak / 2**20:.0f} | {os.path.getsize(path) / 2**20:.0f} |",
              flush=True)
        del llms, first
    return 0


if __name__ == "__main__":
    sys.exit(main())
