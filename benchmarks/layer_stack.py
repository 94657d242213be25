"""All GGUF-block layers in one compiled call per decoding step, against one call per layer half.

``LlamaForCausalLM.layer_stack`` (``QuantizedLayerStack``) runs every layer and its attention
in one ctypes call when the compiled attention kernel serves the whole step; setting it to
None makes the same engine take the per-layer path (two compiled calls per layer around the
attention call from Python). Same engine, same prompt, greedy, batch 1, 96 tokens per
answer (prefill included), the two paths alternating round by round; medians of tok/s.

    python benchmarks/layer_stack.py --rounds 6
    python benchmarks/layer_stack.py --rounds 6 --int8-activations
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--int8-activations", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from specserve import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=1024, int8_activations=args.int8_activations)
    model = llm.engine.runner.model
    stack = model.layer_stack
    if stack is None:
        raise SystemExit("the one-call path is not available here (no GGUF blocks, no compiled kernels)")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = "Write a short story about a robot who learns to paint."
    llm.generate([prompt], params, use_tqdm=False)               # warm-up: kernels built, pages in
    rates = {"one call per step": [], "per-layer calls": []}
    outputs = {}
    for r in range(args.rounds):
        names = list(rates) if r % 2 == 0 else list(reversed(rates))
        for name in names:
            model.layer_stack = stack if name == "one call per step" else None
            t = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            rates[name].append(len(out.token_ids) / (time.perf_counter() - t))
            outputs.setdefault(name, out.token_ids)
    model.layer_stack = stack
    assert outputs["one call per step"] == outputs["per-layer calls"], "the two paths' greedy tokens differ"
    print(f"model {llm.engine.model_name}, int8 activations {args.int8_activations}, {args.threads} threads, "
          f"{args.tokens} tokens, {args.rounds} rounds; greedy tokens identical on both paths")
    print("| path | median tok/s | rounds |")
    print("|---|---|---|")
    for name, v in rates.items():
        print(f"| {name} | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    ratio = statistics.median(rates["one call per step"]) / statistics.median(rates["per-layer calls"])
    print(f"one call / per layer: {ratio:.2f}x")


if __name__ == "__main__":
    main()
