"""Sampling with top-p and top-k: the sampler ranking only each row's head (``torch.topk``, what
specserve does) against ranking the whole vocabulary (a full sort, what it did before), plain
decoding and a draft model, in one process, interleaved prompt by prompt.

Both ways go through ``sampler.top_k_top_p``; the full sort is the same function told that some
row needs every rank. With the same seeds both give the same tokens (checked and printed).

    python benchmarks/top_k_top_p.py --prompts 3 --max-tokens 64
"""
import argparse
import dataclasses
import time

from specserve import LLM, SamplingParams
from specserve.bench.options import load_prompts
from specserve.sample import sampler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--prompts", type=int, default=3, help="the first N of the 20 coding prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    args = p.parse_args()

    kw = dict(model=args.target, max_model_len=2048, kv_cache_memory=1 << 28)
    engines = {"plain": LLM(**kw),
               f"draft:{args.k}": LLM(**kw, speculative_config={"model": args.draft, "num_speculative_tokens": args.k})}
    tok = engines["plain"].get_tokenizer()
    head = sampler.top_k_top_p

    def full_sort(logits, st, **_):
        return head(logits, dataclasses.replace(st, max_top_k=logits.shape[-1]))

    settings = {"top_p 0.95": dict(top_p=0.95), "top_k 40, top_p 0.95": dict(top_k=40, top_p=0.95)}
    for llm in engines.values():
        llm.generate("def f(", SamplingParams(temperature=args.temperature, top_p=0.9, max_tokens=4))
    totals = {}
    try:
        for i, q in enumerate(load_prompts("coding", None, None)[: args.prompts]):
            text = tok.apply_chat_template([{"role": "user", "content": q.text}], tokenize=False,
                                           add_generation_prompt=True)
            for setting, extra in settings.items():
                params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=1, **extra)
                for engine, llm in engines.items():
                    for way in (["head", "full sort"] if i % 2 == 0 else ["full sort", "head"]):
                        sampler.top_k_top_p = head if way == "head" else full_sort
                        start = time.perf_counter()
                        out = llm.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids
                        acc = totals.setdefault((setting, engine, way), [0, 0.0, []])
                        acc[0] += len(out)
                        acc[1] += time.perf_counter() - start
                        acc[2].append(out)
    finally:
        sampler.top_k_top_p = head
    print(f"{args.target}, temperature {args.temperature}, {args.prompts} coding prompts x {args.max_tokens} tokens")
    print("| sampling | engine | head: tok/s | full sort: tok/s | head / full sort | same tokens |")
    print("|---|---|---|---|---|---|")
    for setting in settings:
        for engine in engines:
            h, f = totals[(setting, engine, "head")], totals[(setting, engine, "full sort")]
            print(f"| {setting} | {engine} | {h[0] / h[1]:.2f} | {f[0] / f[1]:.2f} | {f[1] / h[1]:.2f}x "
                  f"| {h[2] == f[2]} |")


if __name__ == "__main__":
    main()
