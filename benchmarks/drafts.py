"""Trained drafts side by side: plain, n-gram, draft model, EAGLE, and transformers' assisted generation.

Every engine answers the SAME chat prompts (the first turn of each prompt in
benchmarks/prompts/default.jsonl, chat categories by default) at batch 1, with
the same number of new tokens (``ignore_eos`` / ``min_new_tokens``), greedy and
sampled. Engines are interleaved prompt by prompt, rotating their order, so a
noisy shared machine slows all of them alike.

Engines:

- ``plain``: specserve, no speculation;
- ``ngram``: prompt lookup;
- ``draft_model``: the trained standalone draft (default: the one shipped for the default model);
- ``eagle``: the trained EAGLE head (default: the shipped one);
- ``hf``: transformers ``generate`` on the same weights, in ``--hf-dtype``
  (default float32, its fastest exact setting on CPUs; specserve runs in ``--dtype``);
- ``hf_assisted``: transformers ``generate(..., assistant_model=draft)`` with the same draft
  (``num_assistant_tokens`` = k, constant schedule).

Reported per engine and temperature: tok/s (all new tokens / all wall time) and
the mean acceptance length (tokens emitted per verification step; plain = 1.0).

    python benchmarks/drafts.py --max-tokens 64 --json-out /tmp/drafts.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPTS = os.path.join(HERE, "prompts", "default.jsonl")
CHAT_CATEGORIES = "writing,qa,roleplay,humanities,stem"
ALL_ENGINES = "plain,ngram,draft_model,eagle,hf,hf_assisted"


def load_chat_prompts(path: str, categories: set[str], limit: int | None) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if row.get("category") in categories:
                    rows.append({"category": row["category"], "text": row["turns"][0]})
    if not rows:
        raise SystemExit(f"no prompts of categories {sorted(categories)} in {path}")
    return rows[:limit] if limit else rows


class SpecserveEngine:
    def __init__(self, name: str, args, spec: dict | None):
        from specserve import LLM

        self.name = name
        self.llm = LLM(dtype=args.dtype, device="cpu" if args.device is None else args.device,
                       kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                       speculative_config=spec)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.apply_chat_template([{"role": "user", "content": text}])

    def run(self, ids: list[int], temperature: float, max_tokens: int, seed: int) -> tuple[int, dict]:
        from specserve import SamplingParams

        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed)
        out = self.llm.generate([ids], params, use_tqdm=False)[0]
        stats = out.spec_decode_stats
        return len(out.outputs[0].token_ids), stats


class HFEngine:
    def __init__(self, name: str, args, target_hf, draft_dir: str | None, k: int):
        self.name = name
        self.model = target_hf
        self.draft = None
        if draft_dir is not None:
            from transformers import AutoModelForCausalLM

            self.draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=target_hf.dtype).eval()
            self.draft.generation_config.num_assistant_tokens = k
            self.draft.generation_config.num_assistant_tokens_schedule = "constant"

    def run(self, ids: list[int], temperature: float, max_tokens: int, seed: int) -> tuple[int, None]:
        torch.manual_seed(seed)
        x = torch.tensor([ids])
        kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=temperature > 0,
                      pad_token_id=self.model.generation_config.eos_token_id)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if self.draft is not None:
            kwargs["assistant_model"] = self.draft
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        return out.shape[1] - len(ids), None


def build_hf_target(dtype_name: str):
    """transformers' Llama on the very weights specserve loads, in the same dtype."""
    from specserve.bench.peers import load_transformers_model

    return load_transformers_model(None, dtype_name)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--categories", default=CHAT_CATEGORIES, help="comma-separated (default: the chat categories)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    p.add_argument("--engines", default=ALL_ENGINES)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-model", default=None, help="draft folder (default: the shipped one)")
    p.add_argument("--eagle", default=None, help="EAGLE folder (default: the shipped one)")
    p.add_argument("--dtype", default="auto", help="specserve's dtype")
    p.add_argument("--hf-dtype", default="float32", help="transformers' dtype (target and assistant)")
    p.add_argument("--device", default=None)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specserve.drafts import shipped_draft

    draft_dir = args.draft_model or shipped_draft("draft_model", None)
    eagle_dir = args.eagle or shipped_draft("eagle", None)
    k = args.num_speculative_tokens
    wanted = [e for e in args.engines.split(",") if e]
    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = load_chat_prompts(args.prompts, set(args.categories.split(",")), args.limit)

    engines = {}
    specs = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": k},
             "draft_model": {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k},
             "eagle": {"method": "eagle", "model": eagle_dir, "num_speculative_tokens": k}}
    for name in wanted:
        if name in specs:
            engines[name] = SpecserveEngine(name, args, specs[name])
    tokenizer_engine = next(iter(engines.values())) if engines else SpecserveEngine("plain", args, None)
    if any(n.startswith("hf") for n in wanted):
        target_hf = build_hf_target(args.hf_dtype)
        if "hf" in wanted:
            engines["hf"] = HFEngine("hf", args, target_hf, None, k)
        if "hf_assisted" in wanted:
            engines["hf_assisted"] = HFEngine("hf_assisted", args, target_hf, draft_dir, k)
    token_ids = [tokenizer_engine.tokenize(pr["text"]) for pr in prompts]

    # Warm up every engine once (first-call allocations, lazy imports).
    for e in engines.values():
        e.run(token_ids[0], 0.0, 4, 0)

    results = {(n, t): {"tokens": 0, "seconds": 0.0, "steps": 0, "emitted": 0} for n in engines for t in temps}
    order = list(engines)
    for i, ids in enumerate(token_ids):
        for t in temps:
            for name in order[i % len(order):] + order[: i % len(order)]:
                t0 = time.perf_counter()
                n, stats = engines[name].run(ids, t, args.max_tokens, seed=1000 + i)
                dt = time.perf_counter() - t0
                r = results[(name, t)]
                r["tokens"] += n
                r["seconds"] += dt
                if stats is not None:
                    r["steps"] += stats.num_steps
                    r["emitted"] += stats.num_emitted_tokens
        print(f"prompt {i + 1}/{len(token_ids)} done", file=sys.stderr, flush=True)

    rows = []
    for (name, t), r in results.items():
        tau = r["emitted"] / r["steps"] if r["steps"] else None
        rows.append({"engine": name, "temperature": t, "tok_s": r["tokens"] / r["seconds"],
                     "mean_acceptance_length": tau, "tokens": r["tokens"], "seconds": r["seconds"]})
    base = {t: next((r["tok_s"] for r in rows if r["engine"] == "plain" and r["temperature"] == t), None) for t in temps}
    print(f"\n{len(prompts)} prompts ({args.categories}), batch 1, {args.max_tokens} new tokens, k={k}, "
          f"dtype {args.dtype} (transformers {args.hf_dtype}), torch threads {torch.get_num_threads()}\n")
    print("| engine | temperature | tok/s | vs plain specserve | mean acceptance length |")
    print("|---|---|---|---|---|")
    for r in rows:
        rel = f"{r['tok_s'] / base[r['temperature']]:.2f}x" if base.get(r["temperature"]) else "-"
        tau = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        print(f"| {r['engine']} | {r['temperature']} | {r['tok_s']:.2f} | {rel} | {tau} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "machine": platform.platform(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
