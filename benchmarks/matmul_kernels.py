"""Skinny matmuls on this CPU: why specserve stores weights in float16 here, and
whose fp16-weight kernel it runs.

A decode step multiplies a few rows of activations (1 per request, k+1 when
verifying drafts) by every weight matrix. Two tables, in one run:

1. Each weight shape of the default model alone (so small ones sit in cache):
   ``F.linear`` in float32 and bfloat16, fbgemm's fp16-weight GEMM, and
   specserve's row-invariant fp16-weight kernel (``cpu_gemm``, what
   ``dtype="auto"`` runs on CPUs where it builds).
2. A whole model's matmuls as a forward runs them: 30 layers of distinct random
   weights and the LM head, streamed from memory, fbgemm and specserve's kernel
   interleaved pass by pass (min ms per pass).
3. With ``--end-to-end N``: the default model generating greedily at batch 1 on the
   first N default prompts, two engines in one process (one on specserve's kernel,
   one on fbgemm), interleaved prompt by prompt, plain or with n-gram speculation.

    python benchmarks/matmul_kernels.py --threads 2 [--end-to-end 8 [--ngram]]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specserve.model_executor.layers import cpu_gemm
from specserve.model_executor.layers.fp16_gemm import fbgemm_available

# SmolLM2-135M: fused q/k/v, o, fused gate/up, down, LM head ([out, in]).
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYER_SHAPES = [shape for name, shape in SHAPES.items() if name != "lm_head"]


def time_ms(fn, min_seconds: float = 0.3) -> float:
    for _ in range(3):
        fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n * 1e3


def fbgemm_fn(weight: torch.Tensor):
    packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16.default(x, packed)


def specserve_fn(weight: torch.Tensor):
    half = weight.half().contiguous()
    return lambda x: cpu_gemm.fp16_weight_matmul(x, half, None)


def per_shape_table(rows: list[int]) -> None:
    print("| weight [out, in] | rows | fp32 ms | bf16 ms | fbgemm fp16-weight ms | specserve fp16-weight ms |")
    print("|---|---|---|---|---|---|")
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f)
        w_bf16 = w.bfloat16()
        fbgemm, ours = fbgemm_fn(w), specserve_fn(w)
        for m in rows:
            x = torch.randn(m, in_f)
            x_bf16 = x.bfloat16()
            t32 = time_ms(lambda: F.linear(x, w))
            tbf = time_ms(lambda: F.linear(x_bf16, w_bf16))
            t_fb, t_ours = time_ms(lambda: fbgemm(x)), time_ms(lambda: ours(x))
            print(f"| {name} {[out_f, in_f]} | {m} | {t32:.3f} | {tbf:.3f} | {t_fb:.3f} | {t_ours:.3f} |")


def whole_model_table(rows: list[int], passes: int) -> None:
    weights = [torch.randn(o, i) for _ in range(30) for (o, i) in LAYER_SHAPES] + [torch.randn(*SHAPES["lm_head"])]
    kernels = {"fbgemm": [fbgemm_fn(w) for w in weights], "specserve": [specserve_fn(w) for w in weights]}
    print("\n| rows | fbgemm ms per forward | specserve ms per forward | specserve / fbgemm |")
    print("|---|---|---|---|")
    for m in rows:
        inputs = [torch.randn(m, w.shape[1]) for w in weights]
        best = {name: float("inf") for name in kernels}
        for _ in range(passes):   # interleaved, so both see the same machine
            for name, fns in kernels.items():
                start = time.perf_counter()
                for fn, x in zip(fns, inputs):
                    fn(x)
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
        print(f"| {m} | {best['fbgemm']:.1f} | {best['specserve']:.1f} | {best['specserve'] / best['fbgemm']:.2f} |")


def end_to_end(num_prompts: int, max_tokens: int, ngram: bool) -> None:
    import json
    from pathlib import Path

    from specserve import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 5}
    engines = {"specserve": LLM(speculative_config=spec if ngram else None)}
    serves = cpu_gemm.serves
    cpu_gemm.serves = lambda in_features: False   # the second engine's layers pack for fbgemm
    try:
        engines["fbgemm"] = LLM(speculative_config=spec if ngram else None)
    finally:
        cpu_gemm.serves = serves
    path = Path(__file__).with_name("prompts") / "default.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:num_prompts]
    tok = engines["specserve"].get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                     add_generation_prompt=True) for r in rows]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(texts[:1], params, use_tqdm=False)   # warm-up
    seconds = {name: 0.0 for name in engines}
    tokens, same = 0, 0
    for i, text in enumerate(texts):
        outputs = {}
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            start = time.perf_counter()
            outputs[name] = engines[name].generate([text], params, use_tqdm=False)[0].outputs[0].token_ids
            seconds[name] += time.perf_counter() - start
        tokens += len(outputs["specserve"])
        same += outputs["specserve"] == outputs["fbgemm"]
    rate = {name: tokens / s for name, s in seconds.items()}
    print(f"\n{'n-gram k=5' if ngram else 'plain decoding'}, {len(texts)} prompts x {max_tokens} tokens, batch 1: "
          f"specserve kernel {rate['specserve']:.1f} tok/s, fbgemm {rate['fbgemm']:.1f} tok/s, "
          f"{rate['specserve'] / rate['fbgemm']:.2f}x; greedy outputs identical on {same}/{len(texts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,2,6,16")
    ap.add_argument("--model-rows", default="1,2,3,6,16,64,512", help="row counts of the whole-model table")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--end-to-end", type=int, default=0, metavar="N", help="also generate with N default prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ngram", action="store_true", help="end to end with n-gram speculation (k = 5)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not fbgemm_available() or not cpu_gemm.available():
        raise SystemExit("needs both fbgemm (x86-64 PyTorch) and specserve's kernel (a C compiler, F16C)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    per_shape_table([int(r) for r in args.rows.split(",")])
    whole_model_table([int(r) for r in args.model_rows.split(",")], args.passes)
    if args.end_to_end:
        end_to_end(args.end_to_end, args.max_tokens, args.ngram)


if __name__ == "__main__":
    main()
