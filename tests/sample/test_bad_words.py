"""``SamplingParams.bad_words`` (vLLM's): the output never holds a bad word's token sequence.
A row's ban depends on the tokens before it, drafts included (so speculation gives plain's
tokens), the prompt's last tokens too; a one-token word is banned everywhere. Tiny random model
whose greedy answer is known, so the words are taken from it."""
from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams
from specserve.sample.penalties import adjust_logits, bad_words_token_ids

from proposer_specs import PROPOSERS, proposer_config, tiny_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(61 * i + 5) % 3000 + 200 for i in range(20)]


def test_a_rows_ban_follows_the_tokens_before_it():
    logits = torch.zeros(4, 10)
    params = SamplingParams(bad_words=["x"])                      # the word's tokens are given below
    words = [[3, 4, 5], [7]]
    # rows after: output [.., 3], then drafts [4], [4, 5], [9]
    out = adjust_logits(logits, params, [1, 2], [3], [[], [4], [4, 5], [9]], None, words)
    banned = [set(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in out]
    assert banned == [{7}, {5, 7}, {7}, {7}]
    # the prompt's end counts too
    out = adjust_logits(logits[:1], params, [3, 4], [], [[]], None, words)
    assert set(torch.nonzero(torch.isinf(out[0])).flatten().tolist()) == {5, 7}


def test_words_become_token_sequences_with_and_without_a_space(default_model_tokenizer):
    tok = default_model_tokenizer
    ids = bad_words_token_ids(tok, ["Paris"])
    assert tok.encode("Paris", add_special_tokens=False) in ids and tok.encode(" Paris", add_special_tokens=False) in ids


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return tiny_engine(tiny_llama_dir)


def answer(llm, **kw) -> list[int]:
    [out] = llm.generate(PROMPT, SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **kw}), use_tqdm=False)
    return out.outputs[0].token_ids


def completes(output: list[int], word: list[int], before: list[int] = ()) -> bool:
    """Whether a token of ``output`` completes ``word`` (its earlier tokens may be ``before``'s)."""
    seq = list(before) + list(output)
    return any(seq[i : i + len(word)] == word for i in range(len(before) - len(word) + 1, len(seq) - len(word) + 1)
               if i >= 0)


def words_from(llm, ids: list[int]) -> tuple[list[str], list[list[int]]]:
    """Two bad words made of the greedy answer's own text: tokens 3-4 and token 9."""
    tok = llm.get_tokenizer()
    words = [tok.decode(ids[3:5]).strip(), tok.decode(ids[9:10]).strip()]
    return words, bad_words_token_ids(tok, words)


def test_the_output_holds_no_bad_word(plain):
    free = answer(plain, temperature=0)
    words, seqs = words_from(plain, free)
    assert any(completes(free, s) for s in seqs)
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=4)):
        got = answer(plain, bad_words=words, **kw)
        assert not any(completes(got, s, PROMPT) for s in seqs), (kw, words, seqs, got)
    assert answer(plain, temperature=0, bad_words=words) != free


@pytest.mark.parametrize("spec", PROPOSERS)
def test_speculation_gives_plain_tokens(tiny_llama_dir, tiny_draft_dir, tiny_eagle_dir, plain, spec):
    llm = tiny_engine(tiny_llama_dir, proposer_config(spec, tiny_draft_dir, tiny_eagle_dir))
    words, _ = words_from(plain, answer(plain, temperature=0))
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=8)):
        assert answer(llm, bad_words=words, **kw) == answer(plain, bad_words=words, **kw)


@pytest.mark.parametrize("bad", [[""], ["  "], "word", [3], ["x" * 257], ["w"] * 1025])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="bad_words must be"):
        SamplingParams(bad_words=bad)
