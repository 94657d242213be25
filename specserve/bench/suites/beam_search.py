"""Beam search with speculation against plain beam search.

Each configuration runs ``LLM.beam_search`` (B = ``--beam-width`` beams, ``--max-tokens`` new
tokens, EOS on, length_penalty 1) over the same chat prompts, one prompt at a time, the
configurations of a model in rotating order per prompt (a noisy machine slows all alike):
the project's 20 coding prompts (the first ``--limit``) and Spec-Bench categories
(``--spec-bench``, the first ``--per-category`` questions of each). Configurations:
``plain``, ``draft:K`` (``--draft`` at k = K; ``draft:K:dynamic``: ``dynamic_k`` picks each
step's k up to K), ``draft-tree:K:N[:D]`` (the draft's tree of at most N nodes, top-K children, D
deep, default 4), ``ngram:K``, ``ngram-tree:K``, ``eagle:K`` and ``eagle-tree:K:N[:D]`` (the
model's shipped EAGLE head: the default model has one); the ``--target`` configurations
first, then ``--ngram-configs`` on ``--ngram-model`` (default: the default model).

Reported per configuration: the speed-up over plain beam search of the same model (plain's
total wall time over the configuration's, per prompt set), tau (depths committed per pass:
1.0 for plain; a pass is one target forward of every running beam with its drafts) and how
many searches returned exactly plain's beams (every token, each token's log-probability,
the cumulative log-probability and the score equal as floats).

    specserve bench beam-search --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --configs plain,draft:4 --limit 4 --spec-bench coding,qa,writing --per-category 2
"""
from __future__ import annotations

import json
import sys
import time

from specserve.bench.options import coding_prompts_path, parse_int8_activations, spec_bench_path
from specserve.bench.results import fmt


def add_arguments(p) -> None:
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="anything LLM(model=...) accepts")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="the draft of draft:K")
    p.add_argument("--configs", default="plain,draft:4", help="the target's configurations (plain first; '' for none)")
    p.add_argument("--ngram-model", default=None, help="the model of --ngram-configs (default: the default model)")
    p.add_argument("--ngram-configs", default="plain,ngram:4",
                   help="--ngram-model's configurations: n-gram, and EAGLE where the model ships a head ('' for none)")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=4, help="coding prompts (0: none)")
    p.add_argument("--spec-bench", default="coding,qa,writing", help="Spec-Bench categories ('' for none)")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--int8-activations", default="off",
                   help="every configuration's model: off (float32 activations), on (int8, one piece a value) or a "
                        "piece count 2-4 (LLM's int8_activations; the drafts keep their own default)")


def _rows(path: str, category: str | None, limit: int) -> list[dict]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if category is None or r["category"] == category][:limit]


def speculative_config(config: str, draft: str | None) -> dict | None:
    """A configuration's speculative config (None: plain); ValueError naming the forms for any
    other spelling (a kind's wrong field count, ``:dynamic`` on a kind other than draft)."""
    kind, *nums = config.split(":")
    dynamic = nums[-1:] == ["dynamic"]          # draft:K:dynamic: dynamic_k picks each step's k (at most K)
    nums = nums[:-1] if dynamic else nums
    fields = {"plain": (0, 0), "draft": (1, 1), "draft-tree": (2, 3), "ngram": (1, 1), "ngram-tree": (1, 1),
              "eagle": (1, 1), "eagle-tree": (2, 3)}
    if (kind not in fields or not fields[kind][0] <= len(nums) <= fields[kind][1] or (dynamic and kind != "draft")
            or not all(n.isdigit() for n in nums)):
        raise ValueError(f"unknown configuration {config!r}: plain, draft:K[:dynamic], draft-tree:K:N[:D], ngram:K, "
                         "ngram-tree:K, eagle:K, eagle-tree:K:N[:D]")

    def tree(method: str, model: str | None) -> dict:
        return {"method": method, "model": model, "num_speculative_tokens": int(nums[2]) if len(nums) > 2 else 4,
                "tree": {"top_k": int(nums[0]), "max_nodes": int(nums[1])}}

    specs = {
        "plain": lambda: None,
        "draft": lambda: {"model": draft, "num_speculative_tokens": int(nums[0]), "dynamic_k": dynamic},
        "draft-tree": lambda: tree("draft_model", draft),
        "ngram": lambda: {"method": "ngram", "num_speculative_tokens": int(nums[0])},
        "ngram-tree": lambda: {"method": "ngram", "num_speculative_tokens": int(nums[0]), "prompt_lookup_tree": True},
        "eagle": lambda: {"method": "eagle", "num_speculative_tokens": int(nums[0])},
        "eagle-tree": lambda: tree("eagle", None),
    }
    return specs[kind]()


def _build(model: str | None, draft: str | None, config: str, max_model_len: int, int8_activations: bool | int):
    from specserve import LLM

    kw = dict(model=model, max_model_len=max_model_len, kv_cache_memory=1 << 28, int8_activations=int8_activations)
    spec = speculative_config(config, draft)
    return LLM(**kw) if spec is None else LLM(**kw, speculative_config=spec)


def _beams(out) -> list[tuple]:
    return [(s.tokens, [lp.logprob for d in s.logprobs for lp in d.values()], s.cum_logprob, s.score)
            for s in out.sequences]


def _measure(model, draft, configs: list[str], sets: list[tuple[str, list[dict]]], params, max_model_len,
             int8_activations: bool | int) -> dict:
    """{(set, config): tallies}: every prompt of every set, the configurations rotating."""
    llms = {c: _build(model, draft, c, max_model_len, int8_activations) for c in configs}
    first = llms[configs[0]]
    tally = {}
    for name, rows in sets:
        for i, row in enumerate(rows):
            ids = first.apply_chat_template([{"role": "user", "content": row["turns"][0]}])
            got = {}
            for c in configs[i % len(configs):] + configs[: i % len(configs)]:
                llm = llms[c]
                before = llm.get_spec_decode_stats().as_dict()
                started = time.perf_counter()
                out = llm.beam_search([ids], params)[0]
                seconds = time.perf_counter() - started
                after = llm.get_spec_decode_stats().as_dict()
                t = tally.setdefault((name, c), {"seconds": [], "passes": 0, "depths": 0, "equal": 0, "tokens": []})
                t["seconds"].append(round(seconds, 3))
                t["passes"] += after["num_steps"] - before["num_steps"]
                t["depths"] += after["num_emitted_tokens"] - before["num_emitted_tokens"]
                t["tokens"].append(max(len(s.tokens) - len(ids) for s in out.sequences))
                got[c] = _beams(out)
                print(f"beam-search {name} {row['question_id']} {c}: {seconds:.2f} s", file=sys.stderr, flush=True)
            for c in configs:
                tally[(name, c)]["equal"] += got[c] == got["plain"]
    return tally


def run(args, doc: dict) -> None:
    from specserve.beam_search_params import BeamSearchParams

    doc["params"] = {k: getattr(args, k) for k in ("target", "draft", "configs", "ngram_model", "ngram_configs",
                                                   "beam_width", "max_tokens", "limit", "spec_bench", "per_category",
                                                   "max_model_len", "int8_activations")}
    int8 = parse_int8_activations(args.int8_activations)
    sets = []
    if args.limit:
        sets.append(("coding-20", _rows(coding_prompts_path(), None, args.limit)))
    for cat in filter(None, (c.strip() for c in args.spec_bench.split(","))):
        sets.append((f"spec-bench {cat}", _rows(spec_bench_path(), cat, args.per_category)))
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
    runs = [("target", args.target, args.draft, [c for c in args.configs.split(",") if c])] if args.configs else []
    if args.ngram_configs:
        runs.append(("n-gram", args.ngram_model, None, [c for c in args.ngram_configs.split(",") if c]))
    for _, _, draft, configs in runs:
        if not configs or configs[0] != "plain":
            raise ValueError(f"each model's configurations start with plain, got {configs}")
        for c in configs:   # every spelling checked before any model loads
            speculative_config(c, draft)
    columns = ["model", "configuration"] + [f"{name}: speed-up (tau)" for name, _ in sets] + ["identical beams"]
    rows, samples = [], {}
    for run_name, model, draft, configs in runs:
        tally = _measure(model, draft, configs, sets, params, args.max_model_len, int8)
        label = model or "default (SmolLM2-135M)"
        for c in configs:
            cells, equal, searches = [], 0, 0
            for name, _ in sets:
                t, plain = tally[(name, c)], tally[(name, "plain")]
                tau = t["depths"] / t["passes"] if t["passes"] else None
                cells.append(f"{fmt(sum(plain['seconds']) / sum(t['seconds']), 2, 'x')} ({fmt(tau, 2)})")
                equal, searches = equal + t["equal"], searches + len(t["seconds"])
            rows.append([label, c] + cells + [f"{equal}/{searches}"])
        samples[f"{run_name} run: {label}"] = {f"{name} | {c}": t for (name, c), t in tally.items()}
    doc["table"] = {"columns": columns, "rows": rows}
    doc["notes"] = [f"B = {args.beam_width} beams, {args.max_tokens} new tokens at most, length_penalty 1, EOS on; "
                    "speed-up = plain beam search's wall time / the configuration's, same model, same prompts.",
                    "tau: depths committed per pass (a depth commits only while every running beam's distribution "
                    "is a verified row: engine/beam_search.py)."]
    doc["samples"] = samples
