"""JSON extraction under a schema: plain vs constrained vs every proposer, with and without the
grammar's forced tokens as drafts (issue 43), on the default model.

Each request turns one synthetic record, given as a sentence, into an object of a fixed schema
(name, age, city, email, a status enum, a list of tags), greedy. Configurations:

- ``plain``: no constraint (the answer is whatever the model writes; its schema validity is
  counted too);
- ``constrained``: the schema, plain decoding;
- ``grammar``: the schema, only the grammar's forced tokens as drafts (method "grammar");
- ``ngram``, ``suffix``, ``draft``, ``eagle``: the schema, that proposer without forced drafts;
- ``ngram+forced``, ``suffix+forced``, ``draft+forced``, ``eagle+forced``: with them;
- ``llama-server``: llama.cpp's server on the same GGUF file, the same chat-templated prompt token
  ids and the same schema (its ``json_schema`` field, which it turns into a GBNF grammar), greedy,
  one slot per record of a batch, measured from outside (its own wall time per batch);
- ``llama-server+draft``: the same with the catalog's draft model as its speculative draft
  (``-md``), where the model has one.

Requests are interleaved (record i on every config, in an order rotated per record, so a slow
spell of the shared machine hits them alike), in batches of ``--batch-size`` records.

    python benchmarks/json_extraction.py --records 50
    python benchmarks/json_extraction.py --records 32 --batch-size 16 --configs constrained,grammar,ngram+forced
    python benchmarks/json_extraction.py --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
        --records 20 --configs constrained,suffix+forced,draft+forced,llama-server,llama-server+draft

Printed per config: output tokens/s (wall time of the requests, prefill included), the ratio to
``constrained``, tau (tokens per decoding step), acceptance rate, schema-valid answers, and the
grammar's share of the wall time (constraints.prepare, the verifier's masking, after_append and
the proposers' draft masks, timed around the calls).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema

import specserve.engine.constraints as constraints
import specserve.sample.verify as verify
import specserve.spec_decode.draft_model as draft_model
import specserve.spec_decode.eagle as eagle
from specserve import LLM, SamplingParams, StructuredOutput
from specserve.structured_output.step_masks import StepMasks
from specserve.bench.peers import gguf_path, llama_server_exe, post_json, start_llama_server, stop_process

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


class LlamaServerJson:
    """llama.cpp's ``llama-server`` answering with the schema as its grammar, on ``model``'s GGUF file.

    Prompts go in as token ids (the chat template applied by specserve's tokenizer), so both engines
    read exactly the same prompt; ``/completion`` returns the generated token ids and the text.
    """

    def __init__(self, model: str | None, draft: bool, slots: int, threads: int, max_tokens: int):
        from specserve import catalog

        exe = llama_server_exe(None)
        path = gguf_path(model)
        self.log = open(os.devnull, "w")
        extra = []
        if draft:
            entry = catalog.ENTRIES.get(model or "")
            drafts = getattr(entry, "drafts", None) or ()
            if not drafts:
                raise ValueError(f"{model!r} has no catalog draft for llama-server+draft")
            extra = ["-md", gguf_path(drafts[0]), "--draft-max", "4", "--draft-min", "0"]
        self.proc, self.base = start_llama_server(exe, path, threads, 4096 * slots, slots, log=self.log,
                                                  extra_args=extra)
        self.pool = ThreadPoolExecutor(slots)
        self.max_tokens = max_tokens

    def _one(self, ids: list[int]) -> tuple[str, int]:
        out = post_json(self.base + "/completion", {
            "prompt": ids, "n_predict": self.max_tokens, "temperature": 0.0, "top_k": 1, "json_schema": SCHEMA,
            "cache_prompt": False, "return_tokens": True, "stream": False})
        return out.get("content", ""), len(out.get("tokens") or []) or int(out.get("tokens_predicted", 0))

    def answer(self, prompt_ids: list[list[int]]) -> list[tuple[str, int]]:
        return list(self.pool.map(self._one, prompt_ids))

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        stop_process(self.proc)
        self.log.close()


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


class GrammarClock:
    """Seconds the step spends in the grammar's calls (wrapped once, module-wide). With the masks
    overlapped (``--overlap-masks``), their computation runs beside the forward and only the wait
    for them after it counts."""

    def __init__(self):
        self.seconds = 0.0
        for owner, name in ((constraints.Constraints, "prepare"), (constraints.Constraints, "after_append"),
                            (constraints.Constraints, "wait_masks"),
                            (verify, "mask_verified_rows"), (draft_model, "mask_draft_rows"),
                            (eagle, "mask_draft_rows")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return wrapper


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None, help="the draft of the draft configurations (default: the "
                    "default model's shipped draft; a catalog name such as qwen2.5-coder-0.5b-instruct)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--overlap-masks", choices=["on", "off", "auto"], default="auto",
                    help="compute the verification masks in a background thread during the forward "
                         "(auto: the engine's default, on for CUDA only)")
    args = ap.parse_args()
    names = args.configs.split(",")
    clock = GrammarClock()
    engines, peers = {}, {}
    for name in names:
        if name in PEERS:
            continue
        spec, _ = CONFIGS[name]
        if spec and spec["method"] == "draft_model" and args.draft_model:
            spec = {**spec, "model": args.draft_model}
        engines[name] = LLM(model=args.model, speculative_config=spec) if spec else LLM(model=args.model)
        if args.overlap_masks != "auto":
            engines[name].engine.constraints.masks = StepMasks(overlap=args.overlap_masks == "on")
    templater = next(iter(engines.values()), None) or LLM(model=args.model)
    threads = __import__("torch").get_num_threads()
    for name in names:
        if name in PEERS:
            peers[name] = LlamaServerJson(args.model, name.endswith("+draft"), args.batch_size, threads, args.max_tokens)
    tallies = {n: {"tokens": 0, "seconds": 0.0, "grammar": 0.0, "valid": 0, "answers": 0} for n in names}
    items = records(args.records)
    batches = [items[i : i + args.batch_size] for i in range(0, len(items), args.batch_size)]
    for b, batch in enumerate(batches):
        for name in names[b % len(names):] + names[: b % len(names)]:
            t = tallies[name]
            if name in peers:
                ids = [templater.apply_chat_template(prompt(r)) for r in batch]
                if b == 0:   # warm, as for specserve's engines (the grammar is built per request there)
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
    base = tallies.get("constrained")
    print(f"{args.records} records, batch size {args.batch_size}, greedy, max_tokens {args.max_tokens}, "
          f"masks overlapped: {args.overlap_masks}")
    print(f"{'config':15s} {'tok/s':>7s} {'vs constrained':>15s} {'tau':>6s} {'accept':>7s} {'valid':>8s} {'grammar':>8s}")
    rows = {}
    for p in peers.values():
        p.close()
    for name in names:
        t = tallies[name]
        d = (engines[name].get_spec_decode_stats().as_dict() if name in engines
             else {"mean_acceptance_length": float("nan"), "acceptance_rate": float("nan")})
        speed = t["tokens"] / t["seconds"]
        ratio = speed / (base["tokens"] / base["seconds"]) if base else float("nan")
        rows[name] = {**t, "tok_per_s": speed, "vs_constrained": ratio, "tau": d["mean_acceptance_length"],
                      "acceptance_rate": d["acceptance_rate"]}
        print(f"{name:15s} {speed:7.1f} {ratio:14.2f}x {d['mean_acceptance_length']:6.2f} {d['acceptance_rate']:7.2f} "
              f"{t['valid']:3d}/{t['answers']:<4d} {t['grammar'] / t['seconds'] * 100:7.1f}%")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "configs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
