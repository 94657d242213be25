"""Structured output after reasoning (``StructuredOutput.after_reasoning``) on the tiny random
model, plain and under speculation: the reasoning is the model's own, token for token, and the
answer after ``</think>`` follows the constraint."""
from __future__ import annotations

import re

import pytest

from specserve import LLM, SamplingParams, StructuredOutput
from specserve.reasoning_formats import CLOSE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Think, then answer in JSON: "
SCHEMA = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
SPECULATION = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "draft": "tiny_draft_dir",
}


@pytest.fixture(scope="module", params=sorted(SPECULATION))
def llm(request, tiny_llama_dir):
    spec = SPECULATION[request.param]
    if spec == "tiny_draft_dir":
        spec = {"model": request.getfixturevalue("tiny_draft_dir"), "num_speculative_tokens": 3}
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               speculative_config=spec)


@pytest.fixture(scope="module")
def free_greedy(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]


def test_the_reasoning_is_the_models_own(llm, free_greedy):
    """Before </think> nothing is constrained: greedy output equals the unconstrained model's
    (which writes no closing tag here), where the schema alone would have forced a "{" first."""
    assert CLOSE not in free_greedy.text and not free_greedy.text.startswith("{")
    so = StructuredOutput(json_schema=SCHEMA, after_reasoning="deepseek_r1")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, structured_output=so),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_greedy.token_ids


def tag_params(tok, seed: int) -> SamplingParams:
    """Sampling that all but forces the pieces of "</think>" (a bias of 100 each), then ">"s."""
    pieces = tok.encode(CLOSE, add_special_tokens=False)
    assert len(pieces) > 1
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=160, logit_bias={t: 100.0 for t in pieces},
                          structured_output=StructuredOutput(regex=">+", after_reasoning="deepseek_r1"))


@pytest.fixture(scope="module")
def tag_reference(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    outs = llm.generate([PROMPT] * 3, [tag_params(llm.engine.tokenizer, s) for s in (7, 8, 9)], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_the_answer_after_the_tag_follows_the_constraint(llm, tag_reference):
    """The bias makes the model write the tag by chance among its pieces; after it the regex
    allows ">" only. Without the reasoning first, the regex would have held from the first token
    and no tag could be written. Seeded: every speculation method gives the plain sample."""
    outs = llm.generate([PROMPT] * 3, [tag_params(llm.engine.tokenizer, s) for s in (7, 8, 9)], use_tqdm=False)
    for out, ref in zip(outs, tag_reference):
        text = out.outputs[0].text
        reasoning, tag, answer = text.partition(CLOSE)
        assert tag and re.fullmatch(">+", answer), text
        assert out.outputs[0].token_ids == ref.token_ids
    assert len({o.outputs[0].text for o in outs}) > 1
