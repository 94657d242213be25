"""JSON extraction under a schema: plain against constrained decoding, every proposer with and
without the grammar's forced tokens as drafts, and llama.cpp's ``llama-server`` with the same
``json_schema``, on the same GGUF file.

Each request turns one synthetic customer record, given as a sentence, into an object of a
fixed schema (name, age, city, email, a status enum, a list of tags), greedy, as a chat
message. Configurations (``--configs``):

- ``plain``: no constraint (its answers' schema validity is counted too);
- ``constrained``: the schema, plain decoding;
- ``grammar``: the schema, only the grammar's forced tokens as drafts (method "grammar");
- ``ngram``, ``suffix``, ``draft``, ``eagle``: the schema, that proposer without forced drafts;
- ``ngram+forced``, ``suffix+forced``, ``draft+forced``, ``eagle+forced``: with them;
- ``llama-server``: llama.cpp's server on the same GGUF file, the same chat-templated prompt
  token ids and the same schema (its ``json_schema`` field, turned into a GBNF grammar there),
  greedy, one slot per record of a batch, measured from outside;
- ``llama-server+draft``: the same with the catalog's draft model as its draft (``-md``).

Records are interleaved (each batch on every configuration, in an order rotated per batch, so
a slow spell of a shared machine hits them alike). Reported per configuration: output tok/s
(wall time of the requests, prefill included), the ratio to ``constrained``, tau (tokens per
target step), the acceptance rate, the schema-valid answers, and the grammar's share of the
wall time (``Constraints.prepare``, ``wait_masks`` and ``after_append``, the verifier's masking
and the proposers' draft masks, timed around the calls; with the masks overlapped, only the
wait for them after the forward counts).
"""
from __future__ import annotations

import json
import random
import time

from specserve.bench.results import fmt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "email": {"type": "string", "maxLength": 60},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "email", "status", "tags"],
    "additionalProperties": False,
}
FIRST = ["Maria", "John", "Aiko", "Lars", "Fatima", "Pedro", "Chen", "Olga", "Kwame", "Sofia", "Liam", "Noor"]
LAST = ["Lopez", "Smith", "Tanaka", "Berg", "Haddad", "Silva", "Wei", "Ivanova", "Mensah", "Rossi", "Walsh", "Khan"]
CITIES = ["Madrid", "Boston", "Osaka", "Oslo", "Cairo", "Lisbon", "Shanghai", "Kyiv", "Accra", "Rome", "Dublin", "Lahore"]
TAGS = ["vip", "new", "newsletter", "wholesale", "returning", "priority"]
STATUS = ["active", "inactive", "pending"]

# name -> (speculative config or None, constrained)
CONFIGS = {
    "plain": (None, False),
    "constrained": (None, True),
    "grammar": ({"method": "grammar"}, True),
    "ngram": ({"method": "ngram", "grammar_drafts": False}, True),
    "ngram+forced": ({"method": "ngram"}, True),
    "suffix": ({"method": "suffix", "grammar_drafts": False}, True),
    "suffix+forced": ({"method": "suffix"}, True),
    "draft": ({"method": "draft_model", "num_speculative_tokens": 4, "grammar_drafts": False}, True),
    "draft+forced": ({"method": "draft_model", "num_speculative_tokens": 4}, True),
    "eagle": ({"method": "eagle", "grammar_drafts": False}, True),
    "eagle+forced": ({"method": "eagle"}, True),
}
PEERS = ("llama-server", "llama-server+draft")
DEFAULT_CONFIGS = "plain,constrained,grammar,ngram+forced,suffix+forced,draft+forced,llama-server"


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or catalog name (default: the default model)")
    p.add_argument("--draft-model", default=None, help="the draft of the draft configurations (default: the "
                   "default model's shipped draft; a catalog name such as qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--records", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated, of {', '.join([*CONFIGS, *PEERS])}")
    p.add_argument("--overlap-masks", choices=["on", "off", "auto"], default="auto",
                   help="compute the verification masks in a background thread during the forward "
                        "(auto: the engine's default, on for CUDA only)")


def records(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first, last, city = rng.choice(FIRST), rng.choice(LAST), rng.choice(CITIES)
        tags = rng.sample(TAGS, rng.randint(0, 3))
        out.append(f"{first} {last}, {rng.randint(18, 90)} years old, lives in {city}; email "
                   f"{first.lower()}.{last.lower()}@example.com; account {rng.choice(STATUS)}"
                   + (f"; tags: {', '.join(tags)}." if tags else "; no tags."))
    return out


def prompt(record: str) -> list[dict]:
    keys = ", ".join(SCHEMA["properties"])
    return [{"role": "user", "content": f"Convert this customer record to a JSON object with the keys {keys}:\n{record}"}]


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


class GrammarClock:
    """Seconds the step spends in the grammar's calls (wrapped module-wide until ``close``)."""

    def __init__(self):
        import specserve.engine.constraints as constraints
        import specserve.sample.verify as verify
        import specserve.spec_decode.draft_model as draft_model
        import specserve.spec_decode.eagle as eagle

        self.seconds = 0.0
        self._originals = []
        for owner, name in ((constraints.Constraints, "prepare"), (constraints.Constraints, "after_append"),
                            (constraints.Constraints, "wait_masks"), (verify, "mask_verified_rows"),
                            (draft_model, "mask_draft_rows"), (eagle, "mask_draft_rows")):
            self._originals.append((owner, name, getattr(owner, name)))
            setattr(owner, name, self._timed(getattr(owner, name)))

    def close(self) -> None:
        """Put the wrapped calls back."""
        for owner, name, fn in self._originals:
            setattr(owner, name, fn)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return wrapper


class LlamaServerJson:
    """llama.cpp's ``llama-server`` answering with the schema as its grammar, on ``model``'s GGUF file
    (with the catalog's draft as its ``-md`` when ``draft``).

    Prompts go in as token ids (the chat template applied by specserve's tokenizer), so both engines
    read exactly the same prompt; ``/completion`` returns the generated token ids and the text.
    """

    def __init__(self, model: str | None, draft: bool, slots: int, threads: int, max_tokens: int):
        from specserve import catalog
        from specserve.bench.peers import LlamaServer, gguf_path

        extra = []
        if draft:
            entry = catalog.ENTRIES.get(model or "")
            if entry is None or not entry.drafts:
                raise ValueError(f"{model!r} has no catalog draft for llama-server+draft")
            extra = ["-md", gguf_path(entry.drafts[0]), "--spec-draft-n-max", "4", "--spec-draft-n-min", "0"]
        self.server = LlamaServer(gguf_path(model), threads, 4096 * slots, slots, extra_args=extra)
        self.max_tokens = max_tokens

    def _one(self, ids: list[int]) -> tuple[str, int]:
        text, tokens = self.server.completion(ids, n_predict=self.max_tokens, temperature=0.0, top_k=1,
                                              json_schema=SCHEMA)
        return text, len(tokens)

    def answer(self, prompt_ids: list[list[int]]) -> list[tuple[str, int]]:
        return self.server.map(self._one, prompt_ids)

    def close(self) -> None:
        self.server.close()


def run(args, doc: dict) -> None:
    import torch

    from specserve import LLM, SamplingParams, StructuredOutput
    from specserve.structured_output.step_masks import StepMasks

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS and n not in PEERS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}: use {', '.join([*CONFIGS, *PEERS])}")
    doc["params"] = {k: getattr(args, k) for k in ("model", "draft_model", "records", "batch_size", "max_tokens",
                                                    "configs", "overlap_masks", "threads")}
    engines, peers = {}, {}
    kw = dict(model=args.model, max_model_len=1024, kv_cache_memory=1 << 28)   # the records need about 300 tokens
    for name in names:
        if name in PEERS:
            continue
        spec = CONFIGS[name][0]
        if spec and spec["method"] == "draft_model" and args.draft_model:
            spec = {**spec, "model": args.draft_model}
        engines[name] = LLM(**kw, speculative_config=spec) if spec else LLM(**kw)
        if args.overlap_masks != "auto":
            engines[name].engine.constraints.masks = StepMasks(overlap=args.overlap_masks == "on")
    templater = next(iter(engines.values()), None) or LLM(**kw)
    threads = args.threads or torch.get_num_threads()
    tallies = {n: {"tokens": 0, "seconds": 0.0, "grammar": 0.0, "valid": 0, "answers": 0} for n in names}
    items = records(args.records)
    batches = [items[i : i + args.batch_size] for i in range(0, len(items), args.batch_size)]
    clock = GrammarClock()
    try:
        for name in names:
            if name in PEERS:
                peers[name] = LlamaServerJson(args.model, name.endswith("+draft"), args.batch_size, threads,
                                              args.max_tokens)
        for b, batch in enumerate(batches):
            for name in names[b % len(names):] + names[: b % len(names)]:
                t = tallies[name]
                if name in peers:
                    ids = [templater.apply_chat_template(prompt(r)) for r in batch]
                    if b == 0:   # warm, as specserve's engines are
                        peers[name].answer(ids[:1])
                    started = time.perf_counter()
                    answers = peers[name].answer(ids)
                    t["seconds"] += time.perf_counter() - started
                    t["tokens"] += sum(n for _, n in answers)
                    t["valid"] += sum(valid(text) for text, _ in answers)
                    t["answers"] += len(answers)
                    continue
                llm, constrained = engines[name], CONFIGS[name][1]
                so = StructuredOutput(json_schema=SCHEMA) if constrained else None
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_output=so)
                if b == 0:   # warm: the first request compiles the schema and builds llguidance's tokenizer
                    llm.chat([prompt(batch[0])], params, use_tqdm=False)
                clock.seconds = 0.0
                started = time.perf_counter()
                outs = llm.chat([prompt(r) for r in batch], params, use_tqdm=False)
                t["seconds"] += time.perf_counter() - started
                t["grammar"] += clock.seconds
                t["tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
                t["valid"] += sum(valid(o.outputs[0].text) for o in outs)
                t["answers"] += len(outs)
    finally:
        clock.close()
        for p in peers.values():
            p.close()
    base = tallies.get("constrained")
    rows, samples = [], {}
    for name in names:
        t = tallies[name]
        d = engines[name].get_spec_decode_stats().as_dict() if name in engines else {}
        speed = t["tokens"] / t["seconds"]
        ratio = speed / (base["tokens"] / base["seconds"]) if base else None
        spec = name not in engines or CONFIGS[name][0] is not None
        samples[name] = {**t, "tok_per_s": speed, "vs_constrained": ratio, "spec_decode": d}
        rows.append([f"`{name}`", fmt(speed), fmt(ratio, 2, "x"),
                     fmt(d.get("mean_acceptance_length"), 2) if spec and d else "—",
                     fmt(d.get("acceptance_rate"), 2) if spec and d else "—",
                     f"{t['valid']}/{t['answers']}",
                     f"{t['grammar'] / t['seconds'] * 100:.1f}%" if name in engines else "—"])
    doc["table"] = {"columns": ["configuration", "tok/s", "vs constrained", "tau", "acceptance", "schema-valid",
                                "grammar share"], "rows": rows}
    doc["notes"] = [f"Model {args.model or 'SmolLM2-135M-Instruct (default)'}; {args.records} records, batch size "
                    f"{args.batch_size}, greedy, at most {args.max_tokens} tokens; masks overlapped: {args.overlap_masks}.",
                    "tok/s: output tokens over the wall time of the requests, prefill included; llama-server: "
                    "the same prompt token ids and json_schema, measured from outside."]
    doc["samples"] = samples
    print("\n".join(" | ".join(r) for r in [doc["table"]["columns"], *rows]))
