"""The tokenizer as llguidance sees it (``structured_output/ll_tokenizer.py``): tokens a model
adds as text (``<tool_call>``, ``<think>``, ``</think>``: Qwen's way) are text to the grammar
too, so a forced tool call and the end of reasoning are written with them as the model does."""
from __future__ import annotations

import copy
import json

import llguidance.hf
import pytest
from tokenizers import AddedToken

from specserve.sampling_params import StructuredOutput
from specserve.structured_output.compiler import GrammarCompiler, request_grammar
from specserve.structured_output.ll_tokenizer import ll_tokenizer

TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tokenizer(default_model_tokenizer):
    """The default model's tokenizer with Qwen's text tokens added, and one added special."""
    tok = copy.deepcopy(default_model_tokenizer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS + ["<pad_here>"]])
    tok.add_special_tokens({"additional_special_tokens": ["<|tool_role|>"]})
    tok.pad_token = "<pad_here>"        # added as text, named as the padding: special all the same
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_added_text_tokens_are_text_and_specials_stay_special(tokenizer):
    ll = ll_tokenizer(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    own = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id)
    text_ids = tokenizer.convert_tokens_to_ids(TEXT_TOKENS)
    assert all(own.is_special_token(i) for i in text_ids)              # llguidance's own reading
    assert not any(ll.is_special_token(i) for i in text_ids)
    assert [ll.decode_bytes([i]) for i in text_ids] == [t.encode() for t in TEXT_TOKENS]
    special, pad = tokenizer.convert_tokens_to_ids(["<|tool_role|>", "<pad_here>"])
    assert ll.is_special_token(special) and ll.is_special_token(pad) and ll.is_special_token(tokenizer.eos_token_id)
    others = [i for i in range(len(tokenizer)) if i not in text_ids]
    assert [ll.decode_bytes([i]) for i in others] == [own.decode_bytes([i]) for i in others]
    assert [ll.is_special_token(i) for i in others] == [own.is_special_token(i) for i in others]
    assert ll.tokenize_str("<tool_call>\n{") == ids(tokenizer, "<tool_call>\n{")


def test_a_tokenizer_without_them_is_read_as_llguidance_reads_it(default_model_tokenizer):
    tok = default_model_tokenizer
    ll = ll_tokenizer(tok, len(tok), tok.eos_token_id)
    own = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=tok.eos_token_id)
    every = list(range(len(tok)))
    assert [ll.decode_bytes([i]) for i in every] == [own.decode_bytes([i]) for i in every]
    assert ll.tokenize_str("<tool_call>") == own.tokenize_str("<tool_call>") == ids(tok, "<tool_call>")


def test_a_forced_tool_call_is_written_with_the_call_token(compiler, tokenizer):
    """tool_choice "required"'s grammar writes "<tool_call>" as text: forced as the model's one
    token (llguidance's own reading refused that token: the constraint could not compile)."""
    schema = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
              "required": ["name", "arguments"]}
    lark = f'start: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {json.dumps(schema)}'
    g = request_grammar(compiler, StructuredOutput(grammar=lark))
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert g.forced_after([])[:1] == tokenizer.convert_tokens_to_ids(["<tool_call>"])
    assert g.valid_prefix(ids(tokenizer, call) + [tokenizer.eos_token_id]) == len(ids(tokenizer, call)) + 1


@pytest.mark.parametrize("fmt", ["deepseek_r1", "qwen3"])
def test_reasoning_ends_at_the_models_own_close_token(compiler, tokenizer, fmt):
    so = StructuredOutput(regex="[0-9]+", after_reasoning=fmt)
    text = ("<think>" if fmt == "qwen3" else "") + "17 * 23 = 391</think>391"
    tokens = ids(tokenizer, text)
    assert tokenizer.convert_tokens_to_ids("</think>") in tokens
    g = request_grammar(compiler, so)
    assert g.valid_prefix(tokens + [tokenizer.eos_token_id]) == len(tokens) + 1
    g.advance(tokens[:-1])                              # after </think>: digits only
    assert g.valid_prefix(ids(tokenizer, "x")) == 0
