"""Compiling constraints (llguidance): every kind compiles, bad ones are refused with a message
that names the problem, limits hold, and compiled grammars (and refusals) are cached."""
from __future__ import annotations

import dataclasses
import json

import pytest

from specserve.sampling_params import SamplingParams, StructuredOutput
from specserve.structured_output.compiler import GrammarCompiler, GrammarLimits, InvalidConstraintError, request_grammar


@pytest.fixture(scope="module")
def compiler(default_model_tokenizer):
    tok = default_model_tokenizer
    return GrammarCompiler(tok, len(tok), tok.eos_token_id)


def accepts(compiler, so: StructuredOutput, text: str) -> bool:
    """Whether the constraint accepts ``text`` whole (tokenized as the model's tokenizer does)."""
    g = request_grammar(compiler, so)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return g.valid_prefix(ids + [compiler.eos_token_id]) == len(ids) + 1


@pytest.mark.parametrize("so, good, bad", [
    (StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": False}), '{"a": 12}', '{"a": "12"}'),
    (StructuredOutput(json_schema='{"enum": ["x", "y"]}'), '"y"', '"z"'),
    (StructuredOutput(json_object=True), '{"k": [1, 2]}', '[1, 2]'),
    (StructuredOutput(regex=r"[0-9]{3}-[a-z]+"), "123-abc", "12-abc"),
    (StructuredOutput(choice=["yes", "no", 'say "maybe"']), 'say "maybe"', "maybe"),
    (StructuredOutput(grammar='start: "(" start ")" | "x"'), "((x))", "((x)"),          # Lark
    (StructuredOutput(grammar='root ::= "a" root | "b"'), "aab", "aba"),                  # GBNF
])
def test_each_kind_compiles_and_constrains(compiler, so, good, bad):
    assert accepts(compiler, so, good)
    assert not accepts(compiler, so, bad)


def test_json_is_written_compactly_with_the_usual_separators(compiler):
    so = StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                                       "required": ["a", "b"], "additionalProperties": False})
    assert accepts(compiler, so, '{"a": 1, "b": true}')
    assert not accepts(compiler, so, '{"a":1,"b":true}')
    assert not accepts(compiler, so, '{"a": 1,\n "b": true}')


@pytest.mark.parametrize("so, words", [
    (StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (StructuredOutput(json_schema={"$ref": "#/$defs/missing"}), "missing"),
    (StructuredOutput(json_schema={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutput(regex="(a|b"), "regex"),
    (StructuredOutput(grammar='root ::= "a" missing_rule'), "missing_rule"),
    (StructuredOutput(grammar="start: (("), "grammar"),
])
def test_bad_constraints_are_refused_naming_the_problem(compiler, so, words):
    with pytest.raises(InvalidConstraintError, match=words) as err:
        compiler.compile(so)
    assert isinstance(err.value, ValueError) and err.value.kind == so.kind


def test_too_large_is_refused_before_compiling(default_model_tokenizer):
    tok = default_model_tokenizer
    small = GrammarCompiler(tok, len(tok), tok.eos_token_id, GrammarLimits(max_source_bytes=1000))
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(100)}}
    with pytest.raises(InvalidConstraintError, match="more than the limit of 1000") as err:
        small.compile(StructuredOutput(json_schema=schema))
    assert err.value.code == "structured_output_too_large"


def test_a_grammar_over_the_size_limit_is_refused(default_model_tokenizer):
    """llguidance's own bound on the compiled grammar (symbols), below the text-size bound."""
    tok = default_model_tokenizer
    tight = GrammarCompiler(tok, len(tok), tok.eos_token_id, GrammarLimits(max_grammar_size=50))
    schema = {"type": "object", "properties": {f"k{i}": {"enum": [f"v{j}" for j in range(20)]} for i in range(40)}}
    with pytest.raises(InvalidConstraintError, match="grammar size"):
        tight.compile(StructuredOutput(json_schema=schema))


def test_compiled_grammars_and_refusals_are_cached(compiler):
    so = StructuredOutput(regex="[a-c]{2,4}")
    assert compiler.compile(so) is compiler.compile(StructuredOutput(regex="[a-c]{2,4}"))
    bad = StructuredOutput(regex="(unclosed")
    with pytest.raises(InvalidConstraintError) as first:
        compiler.compile(bad)
    with pytest.raises(InvalidConstraintError) as second:
        compiler.compile(StructuredOutput(regex="(unclosed"))
    assert first.value is second.value


def test_property_order_is_the_schema_order(compiler):
    so = StructuredOutput(json_schema={"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}},
                                       "required": ["z", "a"], "additionalProperties": False})
    assert accepts(compiler, so, '{"z": 1, "a": 2}')
    assert not accepts(compiler, so, '{"a": 2, "z": 1}')


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json_schema": "not json"}, "not JSON"),
    ({"json_schema": [1, 2]}, "JSON object"),
    ({"regex": ""}, "non-empty"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"json_object": "yes"}, "json_object"),
])
def test_structured_output_checks_its_shape(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutput(**kwargs)


def test_sampling_params_take_a_dict_too():
    p = SamplingParams(structured_output={"regex": "a+"})
    assert p.structured_output == StructuredOutput(regex="a+")
    assert json.loads(StructuredOutput(json_schema={"b": 1, "a": 2}).source) == {"b": 1, "a": 2}
    with pytest.raises(ValueError, match="StructuredOutput"):
        SamplingParams(structured_output="a+")


# ---------------------------------------------------------------- after reasoning
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def grammar_after(compiler, so: StructuredOutput, text: str):
    """The request's grammar after ``text`` (tokenized as the model does), or None if it refused a token."""
    g = request_grammar(compiler, so)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    if g.valid_prefix(ids) < len(ids):
        return None
    g.advance(ids)
    return g


@pytest.mark.parametrize("answer", [
    StructuredOutput(json_schema=SCHEMA), StructuredOutput(regex="[0-9]+"), StructuredOutput(choice=["yes", "no"]),
    StructuredOutput(grammar='root ::= "a" root | "b"'),
])
@pytest.mark.parametrize("fmt", ["deepseek_r1", "qwen3"])
def test_the_answer_after_reasoning_follows_the_constraint(compiler, answer, fmt):
    good = {"json_schema": '{"a": 12}', "regex": "42", "choice": "no", "grammar": "aab"}[answer.kind]
    so = dataclasses.replace(answer, after_reasoning=fmt)
    opened = "<think>" if fmt == "qwen3" else ""
    reasoning = opened + 'Free text: {"a": "x"} is not it, </thinking> is no tag.\n</think>'
    assert accepts(compiler, so, reasoning + good)
    assert not accepts(compiler, so, reasoning + "\n\n" + good)      # the answer starts right after the tag
    assert not accepts(compiler, so, reasoning + good + "</think>")
    assert not accepts(compiler, so, reasoning + "maybe")
    g = grammar_after(compiler, so, reasoning)
    assert g is not None and not g._m.is_accepting()                  # no end of sequence before the answer
    assert accepts(compiler, so, opened + "cut off while thinking, no tag")   # the reasoning may end the output
    assert accepts(compiler, so, good)       # qwen3: an answer without reasoning; deepseek_r1: reasoning cut off
    if fmt == "qwen3":
        assert not accepts(compiler, so, "Free text</think>" + good)  # reasoning only after an opening <think>


def test_the_reasoning_is_free(compiler):
    """While reasoning, every token is allowed but the special ones other than the end of sequence,
    and the byte tokens that cannot start UTF-8 (a continuation byte, 0xC0, 0xC1, 0xF5-0xFF)."""
    so = StructuredOutput(json_schema=SCHEMA, after_reasoning="deepseek_r1")
    g = grammar_after(compiler, so, "Let me see: {")
    mask = g._m.compute_bitmask()
    allowed = {t for t in range(compiler.vocab_size) if mask[t // 8] >> (t % 8) & 1}
    tok = compiler.ll_tokenizer()
    def starts_utf8(t: int) -> bool:
        first = tok.decode_bytes([t])[0]
        return first < 0x80 or 0xC2 <= first <= 0xF4

    expected = {t for t in range(compiler.vocab_size) if not tok.is_special_token(t) and starts_utf8(t)}
    assert allowed == expected | {compiler.eos_token_id} and len(allowed) > 0.99 * compiler.vocab_size


def test_after_reasoning_is_its_own_cache_entry_and_checks_the_answer(compiler):
    so = StructuredOutput(json_schema=SCHEMA)
    assert compiler.compile(so) is not compiler.compile(dataclasses.replace(so, after_reasoning="qwen3"))
    with pytest.raises(InvalidConstraintError, match="regex"):
        compiler.compile(StructuredOutput(regex="(a|b", after_reasoning="deepseek_r1"))
    with pytest.raises(InvalidConstraintError, match="too complex"):   # the answer's probe runs on its own
        compiler.compile(StructuredOutput(regex="a{1000}{1000}", after_reasoning="deepseek_r1"))
    with pytest.raises(ValueError, match="after_reasoning must be one of"):
        StructuredOutput(json_object=True, after_reasoning="o1")
