"""Mean acceptance length (tau) of the two cross-vocabulary methods, side by side.

A draft with another tokenizer drafts by SLEM (its text tokenized again for the target) or
TLI (its distribution on the tokens both vocabularies share); docs/speculative_decoding.md,
"Drafts with another tokenizer". tau counts tokens per verification step, so it does not
depend on the machine or its load, unlike tok/s (``specserve bench`` measures those).

    python benchmarks/cross_vocab_tau.py --target gemma-3-270m --draft smollm2-135m-instruct --temperatures 0,0.7
    python benchmarks/cross_vocab_tau.py --draft gemma-3-270m --prompts 10 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from specserve import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="the target (default: the default model)")
    p.add_argument("--draft", required=True, help="a draft with another tokenizer")
    p.add_argument("--prompts-file", default=os.path.join(HERE, "prompts", "coding.jsonl"))
    p.add_argument("--prompts", type=int, default=10, help="the first N prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.prompts_file) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()][: args.prompts]
    kw = dict(max_model_len=1024, kv_cache_memory=128 << 20)
    tok = LLM(model=args.target, **kw).get_tokenizer()
    if tok.chat_template:   # chat prompts where the target has a template, plain-text completions otherwise
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    for method in ("slem", "tli"):
        llm = LLM(model=args.target, **kw, speculative_config={"model": args.draft, "num_speculative_tokens": args.k,
                                                               "cross_vocab": method})
        for t in (float(x) for x in args.temperatures.split(",")):
            before = llm.get_spec_decode_stats().as_dict()   # a copy: the engine's stats object keeps counting
            llm.generate(texts, SamplingParams(temperature=t, max_tokens=args.max_tokens, ignore_eos=True),
                         use_tqdm=False)
            after = llm.get_spec_decode_stats().as_dict()
            steps, emitted, drafted, accepted = (after[key] - before[key] for key in (
                "num_steps", "num_emitted_tokens", "num_draft_tokens", "num_accepted_tokens"))
            print(f"{args.target or 'default'} <- {args.draft} {method} T={t}: tau {emitted / steps:.3f}, "
                  f"acceptance {accepted / max(drafted, 1):.3f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
