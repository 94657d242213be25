"""A request's matcher: drafts are walked and rolled back without a trace, the end of sequence
is never consumed (llguidance would roll back one token too many over it), trees lose the
branches below an invalid node, and the forced continuation is the grammar's only one."""
from __future__ import annotations

import pytest
import torch

from specserve.sampling_params import StructuredOutput
from specserve.structured_output.bitmask import allowed_tokens, apply_bitmask_, is_allowed
from specserve.structured_output.compiler import GrammarCompiler, request_grammar
from specserve.structured_output.matcher import GrammarLimitError, GrammarStateError

SCHEMA = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "w": {"type": "boolean"}},
          "required": ["v", "w"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(default_model_tokenizer):
    tok = default_model_tokenizer
    return GrammarCompiler(tok, len(tok), tok.eos_token_id)


@pytest.fixture
def grammar(compiler):
    return request_grammar(compiler, StructuredOutput(json_schema=SCHEMA))


def ids(compiler, text: str) -> list[int]:
    return compiler.tokenizer.encode(text, add_special_tokens=False)


def test_masks_of_draft_prefixes_leave_the_state_where_it_was(compiler, grammar):
    text = ids(compiler, '{"v": 3, "w": true}')
    before = grammar.mask_after([]).clone()
    for n in range(len(text) + 1):
        grammar.mask_after(text[:n])
        grammar.forced_after(text[:n])
        assert grammar.valid_prefix(text) == len(text)
    grammar._masks.clear()
    assert torch.equal(grammar.mask_after([]), before)        # recomputed from the live state


def test_each_prefix_mask_allows_exactly_the_next_valid_tokens(compiler, grammar):
    text = ids(compiler, '{"v": 3, "w": true}')
    for n, token in enumerate(text):
        mask = grammar.mask_after(text[:n])
        assert is_allowed(mask, token)
    eos = compiler.eos_token_id
    final = grammar.mask_after(text)
    assert allowed_tokens(final.unsqueeze(0), compiler.vocab_size)[0].nonzero().flatten().tolist() == [eos]


def test_the_end_of_sequence_is_never_consumed(compiler, grammar):
    """A stopped llguidance matcher takes EOS without counting it: a walk that consumed it and
    rolled back would land one token early (this broke draft-model runs before the fix)."""
    text = ids(compiler, '{"v": 3, "w": true}')
    eos = compiler.eos_token_id
    grammar.advance(text[:-1])
    closing = text[-1:]
    assert grammar.valid_prefix(closing + [eos, eos]) == 2          # nothing after the end
    grammar.mask_after(closing + [eos])
    assert grammar.forced_after(closing + [eos]) == []
    assert grammar.forced_after(closing) == [eos]                   # complete: only the end follows
    assert grammar.valid_prefix(closing) == 1                       # the state did not move
    grammar.advance(closing + [eos])
    assert grammar.is_done


def test_advance_refuses_a_token_outside_the_grammar(compiler, grammar):
    with pytest.raises(GrammarStateError, match="doesn't satisfy the grammar") as err:
        grammar.advance(ids(compiler, "[1]"))
    assert not isinstance(err.value, GrammarLimitError)     # a bug, not a limit: "error", not "length"


def test_the_forced_continuation_is_the_schema_boilerplate(compiler, grammar):
    forced = grammar.forced_after([])
    assert compiler.tokenizer.decode(forced) in ('{"v": ', '{"v":')
    after_value = ids(compiler, '{"v": 3')
    # The space before the value is left to the model: " true" is one token of its own.
    assert compiler.tokenizer.decode(grammar.forced_after(after_value)) == ', "w":'
    assert grammar.forced_after(ids(compiler, '{"v": 3, "w": ')) == []          # true or false


def test_a_tree_loses_the_branches_below_an_invalid_node(compiler, grammar):
    grammar.advance(ids(compiler, '{"v": '))
    three, x, comma, brace = ids(compiler, "3")[0], ids(compiler, "x")[0], ids(compiler, ",")[0], ids(compiler, "}")[0]
    #        0      1      2      3      4
    tokens = [three, x, comma, brace, comma]
    parents = [-1, -1, 0, 0, 1]            # 3 -> {",", "}"}; x (invalid) -> ","
    assert grammar.prune_tree(tokens, parents) == [0, 2]   # "}" needs "w" first; below x nothing stays


def test_bitmask_words_and_the_sign_bit():
    vocab = 70
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = -(1 << 31)          # token 31: the sign bit of word 0
    bitmask[0, 2] = 1 << 5              # token 69
    bitmask[1, 1] = 1                   # token 32
    allowed = allowed_tokens(bitmask, vocab)
    assert allowed[0].nonzero().flatten().tolist() == [31, 69]
    assert allowed[1].nonzero().flatten().tolist() == [32]
    logits = torch.zeros(2, vocab)
    apply_bitmask_(logits, bitmask)
    assert torch.isfinite(logits).sum(dim=1).tolist() == [2, 1]
    assert is_allowed(bitmask[0], 31) and not is_allowed(bitmask[0], 30)
