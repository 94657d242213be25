"""Throughput benchmark: specserve vs Hugging Face transformers, plain vs speculative.

Prompts are JSONL in Spec-Bench's format (``question_id``, ``category``, ``turns``);
the first turn is sent as one chat message. Every engine runs the SAME prompts
with the same number of new tokens (greedy, ``ignore_eos`` / ``min_new_tokens``),
or, with ``--stop-at-eos``, Spec-Bench's protocol: each answer ends at the
end-of-sequence token or ``--max-tokens`` (greedy speculative output equals plain
output, so both specserve engines still do the same work), and the engines are interleaved group by group (alternating their order), so a
noisy machine slows all of them alike and the ratios stay meaningful.

Engines compared in one run:

- ``transformers-<dtype>`` (with ``--baseline transformers``): ``generate`` on
  the same weights (built from the specserve loader's state dict), in each of
  ``--baseline-dtypes`` (default bfloat16). specserve runs in ``--dtype``
  (default auto: float16 weights with float32 activations on x86 CPUs), so
  the comparison is each engine in the dtype it is run in;
- ``specserve``: plain decoding;
- ``spec`` (when a ``--speculative-*`` option is given): specserve with speculation;
- ``spec_chain`` (with ``--prompt-lookup-tree --compare-chain``): the same n-gram
  speculation proposing chains, to measure what trees of drafts add.

At batch 1 prompts run one at a time; at batch B they run in groups of exactly B
(the last group is filled up with prompts from the start of the list, so every
group measures B requests in flight), and throughput is total new tokens / total time.
Per-category throughput is reported at batch 1 only (larger groups mix categories);
acceptance figures are per request, so they are reported per category at every size.
"tok/s" is end to end (prefill included, as Spec-Bench measures); "decode tok/s"
(specserve engines only) counts the tokens after each request's first one over the
time after the group's last first token, so long prompts' prefill does not dilute
the effect of speculation. Batch sizes run one after the other, so a ratio between
batch sizes is exposed to load changes on a shared machine; ratios within one
batch size are interleaved.

For one command that runs plain decoding and several proposers (and peers) per
category, batch size and temperature and writes a report with plots, use
``specserve bench`` (specserve/bench/, docs/benchmarks.md). This script stays for
what that command does not measure: decode tok/s with prefill excluded, n-gram
trees against chains (``--compare-chain``), transformers in several dtypes, and
the runs logged in docs/benchmarks.md with its command lines.

    python benchmarks/benchmark.py --baseline transformers --batch-sizes 1,16
    python benchmarks/benchmark.py --speculative-method ngram --num-speculative-tokens 4 \\
        --prompt-lookup-max 3 --batch-sizes 1,16 --baseline none
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPTS = os.path.join(HERE, "prompts", "default.jsonl")


# --------------------------------------------------------------------------- prompts
@dataclass
class Prompt:
    question_id: str
    category: str
    text: str
    token_ids: list[int] = field(default_factory=list)


def load_prompts(path: str, categories: list[str] | None, limit_per_category: int | None) -> list[Prompt]:
    prompts: list[Prompt] = []
    per_cat: dict[str, int] = defaultdict(int)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                cat, turns = row["category"], row["turns"]
            except KeyError as e:
                raise SystemExit(f"{path}:{lineno}: missing key {e}") from None
            if categories and cat not in categories:
                continue
            if limit_per_category is not None and per_cat[cat] >= limit_per_category:
                continue
            per_cat[cat] += 1
            prompts.append(Prompt(str(row.get("question_id", lineno)), cat, turns[0]))
    if not prompts:
        raise SystemExit(f"no prompts selected from {path} (categories={categories})")
    return prompts


# --------------------------------------------------------------------------- engines
@dataclass
class RunResult:
    token_ids: list[list[int]]
    spec_stats: list[object | None]   # SpecDecodeStats per request (specserve only)
    decode_seconds: float | None = None  # last finish - last first token (specserve only): prefill excluded


class SpecserveEngine:
    def __init__(self, name: str, args, speculative_config: dict | None):
        from specserve import LLM

        self.name = name
        self.stop_at_eos = args.stop_at_eos
        kv = int(args.kv_cache_gb * (1 << 30))
        self.llm = LLM(
            model=args.model,
            dtype=args.dtype,
            kv_cache_memory=kv,
            max_model_len=args.max_model_len,
            seed=args.seed,
            speculative_config=speculative_config,
            max_num_seqs=max(64, max(args.batch_sizes)),
        )

    def tokenizer(self):
        return self.llm.get_tokenizer()

    def run(self, prompts: list[Prompt], max_tokens: int, temperature: float) -> RunResult:
        from specserve import SamplingParams

        params = [
            SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=not self.stop_at_eos,
                           seed=None if temperature == 0 else 1000 + i)
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([p.token_ids for p in prompts], params, use_tqdm=False)
        first = [o.metrics.get("first_token_time") for o in outs]
        finish = [o.metrics.get("finish_time") for o in outs]
        decode = max(finish) - max(first) if None not in first and None not in finish else None
        return RunResult([list(o.outputs[0].token_ids) for o in outs], [o.spec_decode_stats for o in outs], decode)


class TransformersEngine:
    """``generate`` on the very weights specserve loads, in the same dtype."""

    def __init__(self, args, dtype_name: str):
        from transformers import AutoModelForCausalLM

        from specserve.model_executor.loader import load_model, resolve_dtype

        dtype = resolve_dtype(dtype_name, torch.device("cpu"))
        self.name = "transformers-" + {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]
        loaded = load_model(args.model, dtype)
        model = AutoModelForCausalLM.from_config(loaded.config, dtype=dtype)
        missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
        model.tie_weights()
        bad = [m for m in missing if not (m == "lm_head.weight" and loaded.config.tie_word_embeddings)]
        if bad or unexpected:
            raise RuntimeError(f"transformers baseline: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")
        self.model = model.eval()
        self.tok = loaded.tokenizer
        pad = self.tok.pad_token_id
        self.pad_id = pad if pad is not None else self.tok.eos_token_id
        self.stop_at_eos = args.stop_at_eos

    @torch.inference_mode()
    def run(self, prompts: list[Prompt], max_tokens: int, temperature: float) -> RunResult:
        width = max(len(p.token_ids) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            n = len(p.token_ids)
            ids[i, width - n:] = torch.tensor(p.token_ids)
            mask[i, width - n:] = 1
        kwargs = dict(max_new_tokens=max_tokens, pad_token_id=self.pad_id)
        if not self.stop_at_eos:
            kwargs.update(min_new_tokens=max_tokens)
        if temperature == 0:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        rows = [row[width:].tolist() for row in out]
        if self.stop_at_eos:  # a batch row that ended early is padded: keep up to its end-of-sequence token
            eos = self.tok.eos_token_id
            rows = [r[: r.index(eos) + 1] if eos in r else r for r in rows]
        return RunResult(rows, [None] * len(prompts))


# --------------------------------------------------------------------------- stats
class Tally:
    """Tokens, seconds and speculation counts of one engine for one bucket."""

    def __init__(self):
        from specserve.outputs import SpecDecodeStats

        self.tokens = 0
        self.seconds = 0.0
        self.decode_tokens = 0      # tokens after each request's first one
        self.decode_seconds = 0.0   # time after the group's last first token
        self.spec = SpecDecodeStats()
        self.has_spec = False

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else None


def fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--categories", default=None, help="comma-separated categories to keep")
    ap.add_argument("--limit-per-category", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="answers end at the end-of-sequence token (Spec-Bench's protocol) instead of "
                         "always running --max-tokens tokens")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--dtype", default="auto", help="specserve's dtype")
    ap.add_argument("--baseline-dtypes", default="bfloat16",
                    help="comma-separated dtypes for the transformers baseline, one engine each")
    ap.add_argument("--model", default=None, help="anything the specserve loader accepts (default: SmolLM2-135M)")
    ap.add_argument("--speculative-method", default=None)
    ap.add_argument("--speculative-model", default=None)
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    ap.add_argument("--prompt-lookup-max", type=int, default=None)
    ap.add_argument("--prompt-lookup-min", type=int, default=None)
    ap.add_argument("--prompt-lookup-adaptive", action=argparse.BooleanOptionalAction, default=None,
                    help="ngram: min(k, match length) draft tokens (specserve's default) or always k")
    ap.add_argument("--prompt-lookup-tree", action=argparse.BooleanOptionalAction, default=None,
                    help="ngram: propose several earlier continuations as a tree of drafts")
    ap.add_argument("--compare-chain", action="store_true",
                    help="with --prompt-lookup-tree: also run the same n-gram speculation with chains (spec_chain)")
    ap.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                    help="no drafting in steps with at least this many decoding requests")
    ap.add_argument("--baseline", choices=["transformers", "none"], default="none")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's choice); on a shared, oversubscribed machine "
                         "use 1: OpenMP threads waiting on descheduled peers made 2 threads ~10x slower here")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    args.categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    return args


def speculative_config_from(args) -> dict | None:
    spec = {}
    if args.speculative_method is not None:
        spec["method"] = args.speculative_method
    if args.speculative_model is not None:
        spec["model"] = args.speculative_model
    if args.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    if args.prompt_lookup_max is not None:
        spec["prompt_lookup_max"] = args.prompt_lookup_max
    if args.prompt_lookup_min is not None:
        spec["prompt_lookup_min"] = args.prompt_lookup_min
    if args.prompt_lookup_adaptive is not None:
        spec["prompt_lookup_adaptive"] = args.prompt_lookup_adaptive
    if args.prompt_lookup_tree is not None:
        spec["prompt_lookup_tree"] = args.prompt_lookup_tree
    if args.speculative_disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.speculative_disable_by_batch_size
    return spec or None


def git_revision() -> str:
    """HEAD, plus '+dirty' when specserve/ has uncommitted changes (other work in the same tree)."""
    import subprocess

    root = os.path.dirname(HERE)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "specserve"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec_cfg = speculative_config_from(args)
    prompts = load_prompts(args.prompts, args.categories, args.limit_per_category)

    engines: list = []
    if args.baseline == "transformers":
        engines += [TransformersEngine(args, d.strip()) for d in args.baseline_dtypes.split(",") if d.strip()]
    engines.append(SpecserveEngine("specserve", args, None))
    if spec_cfg:
        engines.append(SpecserveEngine("spec", args, spec_cfg))
    if args.compare_chain:
        if not (spec_cfg or {}).get("prompt_lookup_tree"):
            raise SystemExit("--compare-chain needs --speculative-method ngram --prompt-lookup-tree")
        engines.append(SpecserveEngine("spec_chain", args, {**spec_cfg, "prompt_lookup_tree": False}))
    names = [e.name for e in engines]

    tok = engines[-1].tokenizer()
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                       add_generation_prompt=True)
        p.token_ids = tok.encode(text, add_special_tokens=False)

    categories = list(OrderedDict.fromkeys(p.category for p in prompts))
    print(f"# {len(prompts)} prompts from {args.prompts}: "
          + ", ".join(f"{c} {sum(p.category == c for p in prompts)}" for c in categories), flush=True)
    print(f"# engines: {names}; speculative config: {spec_cfg}; torch threads {torch.get_num_threads()}", flush=True)

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "loadavg_start": os.getloadavg()},
        "args": {k: v for k, v in vars(args).items()},
        "speculative_config": spec_cfg,
        "engines": names,
        "git": git_revision(),
        "results": {},
    }

    for bs in args.batch_sizes:
        groups = full_groups(prompts, bs)
        num_requests = sum(len(g) for g in groups)
        # Warm up every engine once at this batch size (short run, not timed).
        for e in engines:
            e.run(groups[0], min(8, args.max_tokens), args.temperature)

        tallies = {n: defaultdict(Tally) for n in names}   # engine -> bucket -> Tally
        outputs: dict[str, dict[str, list[int]]] = {n: {} for n in names}
        per_request = []
        t_start = time.perf_counter()
        for gi, group in enumerate(groups):
            order = engines if gi % 2 == 0 else engines[::-1]
            for e in order:
                t0 = time.perf_counter()
                res = e.run(group, args.max_tokens, args.temperature)
                dt = time.perf_counter() - t0
                ntok = sum(len(t) for t in res.token_ids)
                buckets = ["all"] + ([group[0].category] if bs == 1 else [])
                for b in buckets:
                    tallies[e.name][b].tokens += ntok
                    tallies[e.name][b].seconds += dt
                    if res.decode_seconds is not None:
                        tallies[e.name][b].decode_tokens += sum(max(len(t) - 1, 0) for t in res.token_ids)
                        tallies[e.name][b].decode_seconds += res.decode_seconds
                for p, toks, st in zip(group, res.token_ids, res.spec_stats):
                    outputs[e.name][p.question_id] = toks
                    if st is not None:
                        for b in ("all", "cat:" + p.category):
                            tallies[e.name][b].spec.merge(st)
                            tallies[e.name][b].has_spec = True
                    per_request.append({"batch_size": bs, "group": gi, "engine": e.name,
                                        "question_id": p.question_id, "category": p.category,
                                        "num_tokens": len(toks), "group_seconds": round(dt, 4),
                                        "group_decode_seconds": res.decode_seconds,
                                        "spec_decode_stats": st.as_dict() if st is not None else None,
                                        "token_ids": toks})
            done = sum(len(g) for g in groups[:gi + 1])
            print(f"  batch {bs}: {done}/{num_requests} requests, {time.perf_counter() - t_start:.0f}s "
                  + " ".join(f"{n}={tallies[n]['all'].tok_s:.1f}tok/s" for n in names), flush=True)

        report["results"][str(bs)] = summarize(bs, args, names, categories, tallies, outputs, prompts)
        report["results"][str(bs)]["per_request"] = per_request

    report["machine"]["loadavg_end"] = os.getloadavg()
    print()
    print(render_markdown(report, categories))
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json_out}")
    return report


def full_groups(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Groups of exactly ``batch_size`` prompts; the last one wraps around to the first prompts.

    A short last group (4 of 20 prompts at batch 16) would run at a quarter of the
    batch and pull the "batch 16" figure towards batch-4 throughput.
    """
    n = -(-len(prompts) // batch_size) * batch_size
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    return [cycled[i:i + batch_size] for i in range(0, n, batch_size)]


def summarize(bs, args, names, categories, tallies, outputs, prompts) -> dict:
    res: dict = {"batch_size": bs, "rows": {}}
    buckets = (categories if bs == 1 else []) + ["all"]
    for b in buckets:
        row = {}
        for n in names:
            t = tallies[n][b]
            row[n] = {"tokens": t.tokens, "seconds": round(t.seconds, 3), "tok_s": round(t.tok_s, 2)}
            if t.decode_tok_s is not None:
                row[n]["decode_tok_s"] = round(t.decode_tok_s, 2)
            sp = tallies[n]["all" if b == "all" else "cat:" + b]
            if sp.has_spec:
                row[n]["spec_decode"] = sp.spec.as_dict()
        res["rows"][b] = row
    # Acceptance per category at every batch size (per-request stats).
    if "spec" in names:
        res["acceptance_by_category"] = {
            c: tallies["spec"]["cat:" + c].spec.as_dict() for c in categories if tallies["spec"]["cat:" + c].has_spec
        }
    # Output agreement (greedy speculation must be lossless; transformers may differ in bf16 rounding).
    ref = "specserve"
    agree = {}
    for n in names:
        if n == ref:
            continue
        same = [p.question_id for p in prompts if outputs[n].get(p.question_id) == outputs[ref].get(p.question_id)]
        agree[n] = f"{len(same)}/{len(prompts)}"
        for p in prompts:
            a, b = outputs[n].get(p.question_id, []), outputs[ref].get(p.question_id, [])
            if a != b:
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                agree[n] += f"; {p.question_id} differs from token {first}"
    res["identical_to_specserve"] = agree
    return res


def render_markdown(report: dict, categories: list[str]) -> str:
    names = report["engines"]
    lines = [f"Date: {report['date']}  ", f"Command: `{report['command']}`  ",
             f"Code: {report.get('git', 'unknown')}  ",
             f"Machine: {report['machine']['cpu_count']} CPUs, torch {report['machine']['torch']}, "
             f"{report['machine']['torch_threads']} threads, CPU capability {report['machine']['cpu_capability']}, "
             f"load average {report['machine']['loadavg_start'][0]:.1f} at start, "
             f"{report['machine'].get('loadavg_end', [float('nan')])[0]:.1f} at end", ""]
    one = report["results"].get("1")
    for bs_key, res in report["results"].items():
        bs = int(bs_key)
        lines.append(f"### Batch size {bs}")
        lines.append("")
        header = ["category"] + [f"{n} tok/s" for n in names]
        baselines = [n for n in names if n.startswith("transformers")]
        header += [f"specserve / {n}" for n in baselines]
        if "spec" in names:
            header += ["spec / specserve", "decode tok/s specserve → spec", "decode speedup",
                       "acceptance rate", "tau"]
        if "spec_chain" in names:
            header += ["spec_chain / specserve", "spec_chain decode speedup", "spec_chain tau"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for b, row in res["rows"].items():
            cells = [f"**{b}**" if b == "all" else b] + [fmt(row[n]["tok_s"]) for n in names]
            for n in baselines:
                tr = row[n]["tok_s"]
                cells.append(fmt(row["specserve"]["tok_s"] / tr, 2) + "x" if tr else "—")
            if "spec" in names:
                base = row["specserve"]["tok_s"]
                cells.append(fmt(row["spec"]["tok_s"] / base, 2) + "x" if base else "—")
                da, db = row["specserve"].get("decode_tok_s"), row["spec"].get("decode_tok_s")
                cells.append(f"{fmt(da)} → {fmt(db)}")
                cells.append(fmt(db / da, 2) + "x" if da and db else "—")
                sd = row["spec"].get("spec_decode")
                cells += [fmt(sd["acceptance_rate"], 2), fmt(sd["mean_acceptance_length"], 2)] if sd else ["—", "—"]
            if "spec_chain" in names:
                chain, base = row["spec_chain"], row["specserve"]
                cells.append(fmt(chain["tok_s"] / base["tok_s"], 2) + "x" if base["tok_s"] else "—")
                da, db = base.get("decode_tok_s"), chain.get("decode_tok_s")
                cells.append(fmt(db / da, 2) + "x" if da and db else "—")
                sd = chain.get("spec_decode")
                cells.append(fmt(sd["mean_acceptance_length"], 2) if sd else "—")
            lines.append("| " + " | ".join(cells) + " |")
        if bs > 1 and "acceptance_by_category" in res:
            lines.append("")
            lines.append("Acceptance by category at this batch size: " + ", ".join(
                f"{c} {d['acceptance_rate']:.2f} / tau {d['mean_acceptance_length']:.2f}"
                for c, d in res["acceptance_by_category"].items()))
        if bs > 1 and one is not None:
            lines.append("")
            lines.append("Throughput vs batch 1 (same engine): " + ", ".join(
                f"{n} {res['rows']['all'][n]['tok_s'] / one['rows']['all'][n]['tok_s']:.2f}x"
                for n in names if one["rows"]["all"][n]["tok_s"]))
        if res.get("identical_to_specserve"):
            lines.append("")
            lines.append("Outputs identical to plain specserve: " + ", ".join(
                f"{n} {v}" for n, v in res["identical_to_specserve"].items()))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
