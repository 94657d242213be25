"""Every output validates under every JSON schema of ``json_schemas.SCHEMAS``, in plain
decoding and under every proposer (n-gram, suffix, a draft model, n-gram trees, the grammar's
forced tokens alone), greedy and sampled; greedy speculative output is plain greedy output
token for token. Tiny random-weight models: they pick among the allowed tokens almost at
random, so every branch of a schema gets exercised, and forced drafts get rejected often.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from specserve import LLM, SamplingParams, StructuredOutput

from json_schemas import SCHEMAS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = list(SCHEMAS)
PROMPT = "Answer in JSON: "
MAX_TOKENS = 160

# dynamic_k off: module fixtures are built before conftest's per-test default applies, and on
# random models it would cut the drafts this test is about.
SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6, "dynamic_k": False},
    "draft_model": "draft",
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_tree": True, "dynamic_k": False},
    "grammar": {"method": "grammar", "num_speculative_tokens": 6},
}


def params(name: str, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS,
                          structured_output=StructuredOutput(json_schema=SCHEMAS[name]))


@pytest.fixture(scope="module")
def outputs(tiny_llama_dir, tiny_draft_dir):
    """{config: (greedy outputs, sampled outputs)}, one output per schema."""
    result = {}
    for config, spec in SPECS.items():
        if spec == "draft":
            spec = {"method": "draft_model", "model": tiny_draft_dir, "num_speculative_tokens": 3}
        extra = {"speculative_config": spec} if spec else {}
        llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory=32 << 20,
                  max_num_seqs=64, **extra)
        both = llm.generate([PROMPT] * 2 * len(NAMES), [params(n, t) for t in (0.0, 1.0) for n in NAMES],
                            use_tqdm=False)   # one batch: greedy then sampled
        done = [o.outputs[0] for o in both]
        result[config] = (done[: len(NAMES)], done[len(NAMES):], llm.get_spec_decode_stats())
    return result


def assert_valid(completion, name: str) -> None:
    assert completion.finish_reason == "stop", (name, completion.finish_reason, completion.text)
    value = json.loads(completion.text)
    jsonschema.validate(value, SCHEMAS[name], format_checker=jsonschema.FormatChecker())


def test_there_are_at_least_20_schemas():
    assert len(SCHEMAS) >= 20


@pytest.mark.parametrize("config", list(SPECS))
def test_every_output_validates(outputs, config):
    greedy, sampled, _ = outputs[config]
    for name, g, s in zip(NAMES, greedy, sampled):
        assert_valid(g, name)
        assert_valid(s, name)


@pytest.mark.parametrize("config", [c for c in SPECS if c != "plain"])
def test_greedy_speculative_is_greedy_plain(outputs, config):
    plain, _, _ = outputs["plain"]
    greedy, _, stats = outputs[config]
    for name, p, g in zip(NAMES, plain, greedy):
        assert g.token_ids == p.token_ids, name
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0   # drafts were verified


def test_forced_drafts_are_nearly_always_accepted(outputs):
    """The grammar's forced tokens alone: verification still decides, and accepts them unless the
    model splits the forced text into other tokens."""
    _, _, stats = outputs["grammar"]
    assert stats.num_draft_tokens > 100
    assert stats.acceptance_rate > 0.8
