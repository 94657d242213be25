"""EAGLE under a constraint: the head masks its own drafts with the request's grammar, so they
stay inside it (and get accepted), and the output is plain constrained decoding's, greedy token
for token. A tiny random target and a head made from its last layer, as tests/spec_decode/test_eagle.py
builds them."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import specserve.spec_decode.eagle as eagle_module
from specserve import LLM, SamplingParams, StructuredOutput
from specserve.model_executor.loader import load_model
from specserve.training.train_eagle import EagleTask

from json_schemas import SCHEMAS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ["nested_objects", "defs_and_refs", "array_of_objects", "order", "one_of_objects", "string_pattern"]
KW = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, tiny_llama_dir) -> str:
    loaded = load_model(tiny_llama_dir, torch.float32)
    task = EagleTask(loaded.config, loaded.state_dict, torch.arange(0, 49152, 7), "tiny")
    folder = str(tmp_path_factory.mktemp("eagle-constrained"))
    task.export(folder, {})
    return folder


def params(name: str, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=160, seed=11,
                          structured_output=StructuredOutput(json_schema=SCHEMAS[name]))


def eagle_run(tiny_llama_dir, eagle_dir, every):
    eagle = LLM(model=tiny_llama_dir, **KW, speculative_config={"method": "eagle", "model": eagle_dir,
                                                                  "num_speculative_tokens": 3, "grammar_drafts": False})
    return eagle.generate(["JSON: "] * len(every), every, use_tqdm=False), eagle.get_spec_decode_stats()


def test_eagle_drafts_inside_the_grammar(tiny_llama_dir, eagle_dir, monkeypatch):
    plain = LLM(model=tiny_llama_dir, **KW)
    every = [params(n, t) for t in (0.0, 1.0) for n in NAMES]
    want = plain.generate(["JSON: "] * len(every), every, use_tqdm=False)
    got, stats = eagle_run(tiny_llama_dir, eagle_dir, every)
    for p, w, g in zip(every, want, got):
        jsonschema.validate(json.loads(g.outputs[0].text), p.structured_output.json_schema)
        if p.greedy:
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    # A head drafting from the target's own last layer agrees with it often under the mask (37%
    # when written); unmasked, its drafts fall outside the grammar and are cut or rejected (1 of 176).
    monkeypatch.setattr(eagle_module, "mask_draft_rows", lambda logits, reqs, drafts: logits)
    _, unmasked = eagle_run(tiny_llama_dir, eagle_dir, every)
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens > 10 * max(unmasked.num_accepted_tokens, 1)
