"""Where a batch-1 decode step goes: the whole engine step, its forward, and the matmuls alone.

For each ``--dtypes`` entry (``auto``: the GGUF's own blocks through the quantized
kernels and the two compiled calls per layer; ``float16``: weights dequantized to
float16 at load, the PyTorch layer path with specserve's fp16 kernel), interleaved
round by round:

- step: one greedy token at batch 1, engine overhead included (scheduler, sampler,
  output processing), median over ``--tokens`` tokens;
- forward: ``ModelRunner.execute`` of one decode token (context ``--context``);
- matmuls: the same weights multiplied one row at a time in forward order, nothing else;
- non-matmul share: (step - matmuls) / step.

    python benchmarks/step_breakdown.py --dtypes auto,float16 --rounds 3

A dtype entry ``auto+int8`` is ``auto`` with ``int8_activations=True``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def median_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def matmul_pass(model) -> callable:
    """One row through every matmul of the model, in forward order (the layers' own weights)."""
    calls = []
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            width = lin.quantized.in_features if lin.quantized is not None else lin.weight.shape[1]
            calls.append((lin, torch.randn(1, width)))
    head = model.lm_head
    hidden = torch.randn(1, model.config.hidden_size)

    def run():
        for lin, x in calls:
            if lin.quantized is not None:
                lin.quantized.matmul(x)
            elif lin.packed is not None:
                lin.packed(x)
            else:
                torch.nn.functional.linear(x, lin.weight)
        head.compute_logits(hidden)
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtypes", default="auto,float16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from specserve import LLM, SamplingParams
    from specserve.worker.model_runner import ForwardInput

    engines = {d: LLM(model=args.model, dtype=d.split("+")[0], max_model_len=1024, kv_cache_memory=1 << 27,
                      int8_activations=d.endswith("+int8"))
               for d in args.dtypes.split(",")}
    results = {d: {"step": [], "forward": [], "matmuls": []} for d in engines}
    blocks = list(range(-(-(args.context + 1) // 16)))
    for r in range(args.rounds):
        for d in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            engine = engines[d].engine
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            engine.add_request([1] * args.context, params)
            engine.step()   # the prefill
            steps = []
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t)
            results[d]["step"].append(statistics.median(steps) * 1e3)
            inp = [ForwardInput([100], args.context, blocks, 1)]
            results[d]["forward"].append(median_ms(lambda: engine.runner.execute(inp), 30))
            results[d]["matmuls"].append(median_ms(matmul_pass(engine.runner.model), 30))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} threads={args.threads} context={args.context} rounds={args.rounds}")
    print("| dtype | step ms | forward ms | matmuls ms | non-matmul share of the step |")
    print("|---|---|---|---|---|")
    for d, res in results.items():
        step, fwd, mm = (statistics.median(res[k]) for k in ("step", "forward", "matmuls"))
        print(f"| {d} | {step:.2f} | {fwd:.2f} | {mm:.2f} | {(step - mm) / step:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
