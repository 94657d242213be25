"""What ``specserve bench`` runs: every configuration on the same prompts, interleaved.

Work is cut into *units*: one temperature, one batch size, one category, one group
of exactly ``batch_size`` prompts of that category (a category with fewer prompts
is cycled to fill its groups, so every group measures B requests in flight). Each
unit runs every configuration, the configurations in an order rotated by one per
unit, so a noisy machine slows all of them alike. tok/s is new tokens over the
wall time of the group's ``generate`` call (prefill included, as Spec-Bench
measures); "decode tok/s" counts the tokens after each request's first over the
time after the group's last first token (specserve configurations only).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from importlib import resources

import torch

ALL = "all"   # the category that sums the others


# --------------------------------------------------------------------------- prompts
@dataclass
class BenchPrompt:
    question_id: str
    category: str
    text: str
    token_ids: list[int] = field(default_factory=list)


def default_prompts_path() -> str:
    return str(resources.files("specserve.bench").joinpath("prompts.jsonl"))


def load_prompts(path: str | None, categories: list[str] | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Spec-Bench's JSONL (``question_id``, ``category``, ``turns``); the first turn is the prompt.

    ``limit``: at most this many prompts per category (file order).
    """
    path = path or default_prompts_path()
    prompts: list[BenchPrompt] = []
    per_cat: dict[str, int] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                cat, turns = row["category"], row["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Spec-Bench question ({e})") from None
            if categories and cat not in categories:
                continue
            if limit is not None and per_cat.get(cat, 0) >= limit:
                continue
            per_cat[cat] = per_cat.get(cat, 0) + 1
            prompts.append(BenchPrompt(str(row.get("question_id", lineno)), cat, turns[0]))
    if not prompts:
        raise ValueError(f"no prompts selected from {path} (categories={categories}, limit={limit})")
    return prompts


# --------------------------------------------------------------------------- configurations
@dataclass
class Config:
    name: str                          # as written on the command line: plain, ngram:4, draft:3, transformers
    kind: str                          # "specserve" or "peer"
    speculative_config: dict | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "speculative_config": self.speculative_config}


METHODS = {"ngram": "ngram", "draft": "draft_model", "draft_model": "draft_model", "eagle": "eagle", "suffix": "suffix"}


def parse_configs(text: str, draft_model: str | None = None, eagle_model: str | None = None) -> list[Config]:
    """``plain,ngram:4,draft:3,eagle:4`` -> configurations; ``plain`` is added first when missing.

    ``METHOD:K`` speculates K tokens per step (``METHOD`` alone: specserve's default k);
    more ``:OPTION`` parts may follow: ``dynamic`` chooses each step's draft length up
    to K (``dynamic_k``), ``tree`` proposes n-gram trees (``prompt_lookup_tree``), and
    ``KEY=VALUE`` sets any other ``SpeculativeConfig`` field (``ngram:5:prompt_lookup_max=5``;
    VALUE true/false, a number or text). ``draft``/``eagle`` use ``draft_model``/``eagle_model``,
    else the default model's shipped draft.
    """
    from specserve.config import SpeculativeConfig

    configs: list[Config] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if item == "plain":
            cfg = Config("plain", "specserve")
        else:
            method, *parts = item.split(":")
            if method not in METHODS:
                raise ValueError(f"unknown configuration {item!r}: use plain, ngram:K, draft:K, eagle:K or suffix:K")
            spec: dict = {"method": METHODS[method]}
            if parts and parts[0] not in ("dynamic", "tree") and "=" not in parts[0]:
                try:
                    spec["num_speculative_tokens"] = int(parts.pop(0))
                except ValueError:
                    raise ValueError(f"configuration {item!r}: K must be an integer") from None
                if spec["num_speculative_tokens"] < 1:
                    raise ValueError(f"configuration {item!r}: K must be at least 1")
            for part in parts:
                key, eq, value = part.partition("=")
                if not eq and key in ("dynamic", "tree"):
                    key, value = {"dynamic": "dynamic_k", "tree": "prompt_lookup_tree"}[key], "true"
                elif not eq or not key or key in ("method", "num_speculative_tokens"):
                    raise ValueError(f"configuration {item!r}: {part!r} is not dynamic, tree or KEY=VALUE "
                                     "(a SpeculativeConfig field; K goes right after the method)")
                spec[key] = _option_value(value)
            model = {"draft_model": draft_model, "eagle": eagle_model}.get(spec["method"])
            if model is not None and "model" not in spec:
                spec["model"] = model
            try:
                SpeculativeConfig.from_dict(spec)
            except (TypeError, ValueError) as e:
                raise ValueError(f"configuration {item!r}: {e}") from None
            cfg = Config(item, "specserve", spec)
        if any(c.name == cfg.name for c in configs):
            raise ValueError(f"configuration {item!r} given twice")
        configs.append(cfg)
    if not any(c.name == "plain" for c in configs):
        configs.insert(0, Config("plain", "specserve"))
    return configs


def _option_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_list(text: str, kind=float) -> list:
    try:
        values = [kind(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"not a comma-separated list of {kind.__name__}: {text!r}") from None
    if not values:
        raise ValueError(f"empty list: {text!r}")
    return values


# --------------------------------------------------------------------------- engines
@dataclass
class GroupResult:
    token_ids: list[list[int]]
    spec_stats: list[object | None]           # SpecDecodeStats per request (specserve only)
    decode_seconds: float | None = None       # last finish - last first token (specserve only)


class SpecserveEngine:
    def __init__(self, config: Config, opts: "BenchOptions"):
        from specserve import LLM

        self.name = config.name
        self.llm = LLM(
            model=opts.model,
            dtype=opts.dtype,
            device=opts.device,
            max_model_len=opts.max_model_len,
            kv_cache_memory=opts.kv_cache_memory,
            seed=opts.seed,
            speculative_config=config.speculative_config,
            max_num_seqs=max(64, max(opts.batch_sizes)),
            # Off for every configuration: cycled prompts and warm-ups would otherwise
            # skip prefill for some configurations (EAGLE turns it off) and not others.
            enable_prefix_caching=False,
        )
        spec = self.llm.engine.spec_config if hasattr(self.llm.engine, "spec_config") else None
        self.resolved = _spec_as_dict(spec)

    def tokenizer(self):
        return self.llm.get_tokenizer()

    def run(self, prompts: list[BenchPrompt], max_tokens: int, temperature: float, seeds: list[int],
            ignore_eos: bool) -> GroupResult:
        from specserve import SamplingParams

        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                 seed=None if temperature == 0 else s) for s in seeds]
        outs = self.llm.generate([p.token_ids for p in prompts], params, use_tqdm=False)
        first = [o.metrics.get("first_token_time") for o in outs]
        finish = [o.metrics.get("finish_time") for o in outs]
        decode = max(finish) - max(first) if None not in first and None not in finish else None
        return GroupResult([list(o.outputs[0].token_ids) for o in outs], [o.spec_decode_stats for o in outs], decode)

    def close(self) -> None:
        pass


def _spec_as_dict(spec) -> dict | None:
    if spec is None:
        return None
    try:
        import dataclasses

        d = dataclasses.asdict(spec)
    except TypeError:
        return None
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if isinstance(d.get("model"), str) and d["model"].startswith(pkg + os.sep):   # a shipped draft
        d["model"] = "specserve/" + os.path.relpath(d["model"], pkg)
    return {k: v for k, v in d.items() if v is not None and not callable(v)}


# --------------------------------------------------------------------------- options and tallies
@dataclass
class BenchOptions:
    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    configs: list[Config] = field(default_factory=lambda: [Config("plain", "specserve")])
    peers: list[str] = field(default_factory=list)
    llama_cpp_bin: str | None = None
    transformers_dtype: str = "bfloat16"
    prompts_path: str | None = None
    categories: list[str] | None = None
    limit: int | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    max_tokens: int = 128
    stop_at_eos: bool = False
    max_model_len: int = 2048
    kv_cache_memory: int = 1 << 30
    seed: int = 0
    threads: int | None = None
    progress: bool = True
    command: str = ""


class Tally:
    def __init__(self):
        from specserve.outputs import SpecDecodeStats

        self.requests = 0
        self.tokens = 0
        self.seconds = 0.0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.has_decode = False
        self.spec = SpecDecodeStats()
        self.has_spec = False

    def row(self) -> dict:
        d = {"requests": self.requests, "tokens": self.tokens, "seconds": round(self.seconds, 6),
             "tok_s": round(self.tokens / self.seconds, 3) if self.seconds else None,
             "decode_tok_s": (round(self.decode_tokens / self.decode_seconds, 3)
                              if self.has_decode and self.decode_seconds > 0 else None),
             "spec_decode": None}
        if self.has_spec:
            d["spec_decode"] = self.spec.as_dict()
            d["spec_decode"]["accepted_per_position"] = list(self.spec.accepted_per_position)
            d["spec_decode"]["drafted_per_position"] = list(self.spec.drafted_per_position)
        return d


def groups_of(prompts: list[BenchPrompt], batch_size: int) -> list[list[BenchPrompt]]:
    """Groups of exactly ``batch_size`` prompts; the last one wraps around to the first prompts."""
    n = -(-len(prompts) // batch_size) * batch_size
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    return [cycled[i:i + batch_size] for i in range(0, n, batch_size)]


# --------------------------------------------------------------------------- machine facts
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "specserve"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "") if head else "unknown"


def machine_facts() -> dict:
    import specserve

    versions = {"python": platform.python_version(), "torch": torch.__version__, "specserve": specserve.__version__}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    facts = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": versions,
        "git": git_revision(),
    }
    return facts


# --------------------------------------------------------------------------- the run
def build_engines(opts: BenchOptions) -> list:
    engines: list = [SpecserveEngine(c, opts) for c in opts.configs]
    for peer in opts.peers:
        from specserve.bench import peers

        if peer == "transformers":   # one peer per dtype of --transformers-dtype (comma-separated)
            dtypes = list(dict.fromkeys(d.strip() for d in opts.transformers_dtype.split(",") if d.strip()))
            engines += [peers.TransformersPeer(opts, d, named_by_dtype=len(dtypes) > 1) for d in dtypes]
        elif peer == "llama.cpp":
            engines.append(peers.LlamaCppPeer(opts))
        else:
            raise ValueError(f"unknown peer {peer!r}: use transformers or llama.cpp")
    names = [e.name for e in engines]
    if len(set(names)) < len(names):
        for e in engines:
            e.close()
        raise ValueError(f"two configurations of the same name in {names} (e.g. --transformers-dtype bf16,bfloat16)")
    return engines


def run_bench(opts: BenchOptions) -> dict:
    """Run everything; returns the results document (what results.json holds)."""
    from specserve.outputs import SpecDecodeStats  # noqa: F401  (fail early if the package is broken)

    if opts.threads:
        torch.set_num_threads(opts.threads)
    prompts = load_prompts(opts.prompts_path, opts.categories, opts.limit)
    started = datetime.datetime.now(datetime.timezone.utc)
    machine = machine_facts()
    engines = build_engines(opts)
    try:
        return _run(opts, prompts, engines, machine, started)
    finally:
        for e in engines:
            e.close()


def _run(opts: BenchOptions, prompts: list[BenchPrompt], engines: list, machine: dict, started) -> dict:
    tok = engines[0].tokenizer()
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                       add_generation_prompt=True)
        p.token_ids = tok.encode(text, add_special_tokens=False)
    categories = list(OrderedDict.fromkeys(p.category for p in prompts))
    by_cat = {c: [p for p in prompts if p.category == c] for c in categories}
    names = [e.name for e in engines]
    ignore_eos = not opts.stop_at_eos

    units = []   # (temperature, batch size, category, group index, prompts)
    for t in opts.temperatures:
        for bs in opts.batch_sizes:
            for c in categories:
                for gi, g in enumerate(groups_of(by_cat[c], bs)):
                    units.append((t, bs, c, gi, g))

    tallies: dict[tuple, Tally] = {}

    def tally(*key) -> Tally:
        if key not in tallies:
            tallies[key] = Tally()
        return tallies[key]

    per_request = []
    bar = _progress(len(units) * len(engines), opts.progress)
    warmed = set()
    t_start = time.perf_counter()
    try:
        for ui, (t, bs, cat, gi, group) in enumerate(units):
            if (t, bs) not in warmed:   # one short untimed run per engine at each batch size and temperature
                for e in engines:
                    bar.set_postfix_str(f"warm-up {e.name} batch {bs}", refresh=True)
                    e.run(group, min(8, opts.max_tokens), t, [opts.seed + i for i in range(len(group))], ignore_eos)
                warmed.add((t, bs))
            r = ui % len(engines)
            order = engines[r:] + engines[:r]
            seeds = [opts.seed + 1000 * ui + i for i in range(len(group))]
            for e in order:
                bar.set_postfix_str(f"T={t:g} batch {bs} {cat} {e.name}", refresh=False)
                t0 = time.perf_counter()
                res = e.run(group, opts.max_tokens, t, seeds, ignore_eos)
                dt = time.perf_counter() - t0
                ntok = sum(len(x) for x in res.token_ids)
                for c in (cat, ALL):
                    tl = tally(t, bs, c, e.name)
                    tl.requests += len(group)
                    tl.tokens += ntok
                    tl.seconds += dt
                    if res.decode_seconds is not None:
                        tl.has_decode = True
                        tl.decode_tokens += sum(max(len(x) - 1, 0) for x in res.token_ids)
                        tl.decode_seconds += res.decode_seconds
                    for st in res.spec_stats:
                        if st is not None and getattr(st, "num_drafts", 0) + getattr(st, "num_steps", 0) > 0 \
                                and e.name != "plain" and isinstance(e, SpecserveEngine):
                            tl.spec.merge(st)
                            tl.has_spec = True
                for row, (p, ids) in enumerate(zip(group, res.token_ids)):
                    st = res.spec_stats[row]
                    per_request.append({"temperature": t, "batch_size": bs, "category": cat, "unit": ui,
                                        "row": row, "config": e.name, "question_id": p.question_id,
                                        "prompt_tokens": len(p.token_ids), "num_tokens": len(ids),
                                        "group_seconds": round(dt, 6),
                                        "spec_decode": st.as_dict() if st is not None and e.name != "plain" else None,
                                        "token_ids": ids})
                bar.update(1)
    finally:
        bar.close()
    elapsed = time.perf_counter() - t_start
    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    results = []
    for (t, bs, c, name), tl in tallies.items():
        results.append({"temperature": t, "batch_size": bs, "category": c, "config": name, **tl.row()})
    order_cat = {c: i for i, c in enumerate(categories + [ALL])}
    order_name = {n: i for i, n in enumerate(names)}
    results.sort(key=lambda r: (opts.temperatures.index(r["temperature"]), opts.batch_sizes.index(r["batch_size"]),
                                order_cat[r["category"]], order_name[r["config"]]))
    plain_rows = {(r["temperature"], r["batch_size"], r["category"]): r for r in results if r["config"] == "plain"}
    for r in results:
        plain = plain_rows.get((r["temperature"], r["batch_size"], r["category"]), {})
        for rate, speedup in (("tok_s", "speedup_vs_plain"), ("decode_tok_s", "decode_speedup_vs_plain")):
            base = plain.get(rate)
            r[speedup] = round(r[rate] / base, 4) if base and r[rate] else None

    return {
        "schema": "specserve-bench/1",
        "command": opts.command,
        "date": started.isoformat(timespec="seconds"),
        "elapsed_seconds": round(elapsed, 1),
        "machine": machine,
        "settings": {
            "model": opts.model or "default (SmolLM2-135M-Instruct)", "dtype": opts.dtype, "device": opts.device,
            "prompts": opts.prompts_path or "shipped default (specserve/bench/prompts.jsonl)",
            "num_prompts": len(prompts), "limit_per_category": opts.limit, "categories": categories,
            "batch_sizes": opts.batch_sizes, "temperatures": opts.temperatures, "max_tokens": opts.max_tokens,
            "stop_at_eos": opts.stop_at_eos, "max_model_len": opts.max_model_len, "seed": opts.seed,
            "threads": torch.get_num_threads(), "prefix_caching": False,
            "transformers_dtype": opts.transformers_dtype if "transformers" in opts.peers else None,
        },
        "configs": [{"name": e.name, "kind": "specserve" if isinstance(e, SpecserveEngine) else "peer",
                     "speculative_config": getattr(e, "resolved", None), "description": getattr(e, "description", None)}
                    for e in engines],
        "categories": categories,
        "results": results,
        "identical_to_plain": identical_to_plain(per_request, names),
        "per_request": per_request,
    }


def identical_to_plain(per_request: list[dict], names: list[str]) -> list[dict]:
    """Greedy runs only: how many answers of each configuration equal plain decoding's, token for token."""
    plain = {(r["temperature"], r["batch_size"], r["unit"], r["row"]): r["token_ids"]
             for r in per_request if r["config"] == "plain" and r["temperature"] == 0}
    out: dict[tuple, list[int]] = {}
    for r in per_request:
        if r["config"] == "plain" or r["temperature"] != 0:
            continue
        key = (r["batch_size"], r["config"])
        same = out.setdefault(key, [0, 0])
        same[1] += 1
        same[0] += r["token_ids"] == plain.get((r["temperature"], r["batch_size"], r["unit"], r["row"]))
    return [{"temperature": 0.0, "batch_size": bs, "config": n, "identical": s[0], "requests": s[1]}
            for (bs, n), s in sorted(out.items(), key=lambda kv: (kv[0][0], names.index(kv[0][1])))]


class _NoBar:
    def set_postfix_str(self, *a, **k):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="run", desc="bench", file=sys.stderr, dynamic_ncols=True)
