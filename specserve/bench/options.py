"""What a ``specserve bench`` run is asked to do: the prompts, the configurations, the options.

``load_prompts`` reads Spec-Bench's JSONL (default: the shipped ``prompts.jsonl``);
``parse_configs`` turns ``plain,ngram:4,draft:3:dynamic`` into ``Config``s (each
checked as a SpeculativeConfig); ``BenchOptions`` holds everything else
``bench/cli.py`` parsed. Nothing here loads a model.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources

ALL = "all"   # the category that sums the others


# --------------------------------------------------------------------------- prompts
@dataclass
class BenchPrompt:
    question_id: str
    category: str
    text: str
    suffix: str | None = None      # a fill-in-the-middle task: ``text`` is the code before the gap, this after it
    token_ids: list[int] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)   # a fill-in-the-middle task's end-of-middle tokens


def default_prompts_path() -> str:
    return str(resources.files("specserve.bench").joinpath("prompts.jsonl"))


SPEC_BENCH_NAME = "spec-bench"   # what --prompts accepts for Spec-Bench's questions


def spec_bench_path() -> str:
    """Spec-Bench's 480 questions (13 categories): the team's shared copy beside the project,
    ``../shared/data/spec_bench/question.jsonl`` from the project root."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.normpath(os.path.join(root, "..", "shared", "data", "spec_bench", "question.jsonl"))


def coding_prompts_path() -> str:
    """The project's own 20 coding prompts (benchmarks/prompts/coding.jsonl in the checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, "benchmarks", "prompts", "coding.jsonl")


def prompts_path(name: str | None) -> str:
    """--prompts: a JSONL path, ``spec-bench`` (``spec_bench_path()``), ``coding`` (``coding_prompts_path()``),
    ``fill-in-middle`` (benchmarks/prompts/fill_in_middle.jsonl) or None (the shipped set)."""
    if name == SPEC_BENCH_NAME:
        return spec_bench_path()
    if name == "coding":
        return coding_prompts_path()
    if name == "fill-in-middle":
        return os.path.join(os.path.dirname(coding_prompts_path()), "fill_in_middle.jsonl")
    return name or default_prompts_path()


def load_prompts(path: str | None, categories: list[str] | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Spec-Bench's JSONL (``question_id``, ``category``, ``turns``); the first turn is the prompt,
    or with ``suffix`` the code before a fill-in-the-middle gap.

    ``path``: one source (``prompts_path``) or several joined by ``+`` (``coding+spec-bench``:
    the 20 coding prompts, then Spec-Bench's questions), read in that order.
    ``limit``: at most this many prompts per category (file order).
    """
    prompts: list[BenchPrompt] = []
    per_cat: dict[str, int] = {}
    for source in (path.split("+") if path else [None]):
        prompts += _load_one(prompts_path(source), categories, limit, per_cat)
    if not prompts:
        raise ValueError(f"no prompts selected from {path} (categories={categories}, limit={limit})")
    return prompts


def _load_one(path: str, categories: list[str] | None, limit: int | None, per_cat: dict[str, int]) -> list[BenchPrompt]:
    prompts: list[BenchPrompt] = []
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
            prompts.append(BenchPrompt(str(row.get("question_id", lineno)), cat, turns[0], row.get("suffix")))
    return prompts


# --------------------------------------------------------------------------- configurations
@dataclass
class Config:
    name: str                          # as written on the command line: plain, ngram:4, draft:3, transformers
    kind: str                          # "specserve" or "peer"
    speculative_config: dict | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "speculative_config": self.speculative_config}


METHODS = {"ngram": "ngram", "draft": "draft_model", "draft_model": "draft_model", "eagle": "eagle", "eagle3": "eagle3",
           "suffix": "suffix"}


# the :OPTION words of a configuration and the SpeculativeConfig field and value each sets
KEYWORDS = {"dynamic": ("dynamic_k", "true"), "fixed": ("dynamic_k", "false"), "tree": ("prompt_lookup_tree", "true")}


def parse_configs(text: str, draft_model: str | None = None, eagle_model: str | None = None,
                  add_plain: bool = True, eagle3_model: str | None = None) -> list[Config]:
    """``plain,ngram:4,draft:3,eagle:4`` -> configurations; ``plain`` is added first when missing
    (unless ``add_plain`` is False: a suite that compares each configuration with itself).

    ``METHOD:K`` speculates K tokens per step (``METHOD`` alone: specserve's default k);
    more ``:OPTION`` parts may follow: ``dynamic`` chooses each step's draft length up
    to K (``dynamic_k``, n-gram's and suffix's default), ``fixed`` drafts K every step (``dynamic_k``
    off), ``tree`` proposes n-gram trees (``prompt_lookup_tree``), and
    ``KEY=VALUE`` sets any other ``SpeculativeConfig`` field (``ngram:5:prompt_lookup_max=5``;
    VALUE true/false, a number or text). ``draft``/``eagle`` use ``draft_model``/``eagle_model``,
    else the default model's shipped draft; ``eagle3`` uses ``eagle3_model`` (an EAGLE-3 head's folder).
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
                raise ValueError(f"unknown configuration {item!r}: use plain, ngram:K, draft:K, eagle:K, eagle3:K or "
                                 "suffix:K")
            spec: dict = {"method": METHODS[method]}
            if parts and parts[0] not in KEYWORDS and "=" not in parts[0]:
                try:
                    spec["num_speculative_tokens"] = int(parts.pop(0))
                except ValueError:
                    raise ValueError(f"configuration {item!r}: K must be an integer") from None
                if spec["num_speculative_tokens"] < 1:
                    raise ValueError(f"configuration {item!r}: K must be at least 1")
            for part in parts:
                key, eq, value = part.partition("=")
                if not eq and key in KEYWORDS:
                    key, value = KEYWORDS[key]
                elif not eq or not key or key in ("method", "num_speculative_tokens"):
                    raise ValueError(f"configuration {item!r}: {part!r} is not dynamic, fixed, tree or KEY=VALUE "
                                     "(a SpeculativeConfig field; K goes right after the method)")
                spec[key] = _option_value(value)
            model = {"draft_model": draft_model, "eagle": eagle_model, "eagle3": eagle3_model}.get(spec["method"])
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
    if add_plain and not any(c.name == "plain" for c in configs):
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


def parse_int8_activations(item: str) -> bool | int:
    """``--int8-activations``' words: off, on (one int8 piece a value) or a piece count 2-4 ->
    ``LLM(int8_activations=...)``."""
    item = item.strip()
    if item in ("off", "on"):
        return item == "on"
    if item in ("2", "3", "4"):
        return int(item)
    raise ValueError(f"--int8-activations takes off, on or a piece count 2-4, got {item!r}")


def int8_activations_label(setting: bool | int) -> str | None:
    """How tables name an ``int8_activations`` setting: None for float32 activations."""
    return {False: None, True: "int8 act."}.get(setting, f"{setting} int8 pieces")


# --------------------------------------------------------------------------- options
@dataclass
class BenchOptions:
    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    configs: list[Config] = field(default_factory=lambda: [Config("plain", "specserve")])
    peers: list[str] = field(default_factory=list)
    draft_model: str | None = None     # the transformers-assisted peer's assistant (None: the shipped draft)
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
    int8_activations: bool | int = False   # the target's, every configuration's (LLM's int8_activations)
    seed: int = 0
    threads: int | None = None
    progress: bool = True
    command: str = ""
