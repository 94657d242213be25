"""Drafting across vocabularies, below the engine: tokens as bytes, bytes back to tokens, the
mapping and its cache, and one request's draft reading kept in line with the target's text
(``token_table``, ``vocab_map``, ``draft_text``, ``cross_vocab.slem_tokens``).

The target is the default model's byte-level BPE (49,152 tokens); the draft vocabulary a
small Gemma-like one (``cross_vocab_models.sentencepiece_style``: '▁' spaces, ``<0xNN>``
byte pieces, a BOS, pieces across word boundaries).
"""
from __future__ import annotations

import random

import pytest

from specserve.spec_decode import vocab_map
from specserve.spec_decode.cross_vocab import slem_tokens
from specserve.spec_decode.draft_text import SPECIAL_BASE, DraftSequence, draft_symbols, target_symbols
from specserve.spec_decode.token_table import BYTE, SPECIAL, TEXT, TokenTable, TokenText
from specserve.spec_decode.vocab_map import NoUsableOverlapError, VocabularyMismatchError, vocab_mapping

from cross_vocab_models import disjoint, sentencepiece_style


@pytest.fixture(scope="module")
def draft_tokenizer():
    return sentencepiece_style()


@pytest.fixture(scope="module")
def mapping(default_model_tokenizer, draft_tokenizer, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return vocab_mapping(default_model_tokenizer, 49152, draft_tokenizer, len(draft_tokenizer))


@pytest.fixture(scope="module")
def texts(default_model_tokenizer, draft_tokenizer, mapping):
    return TokenText(default_model_tokenizer, mapping.target), TokenText(draft_tokenizer, mapping.draft)


def ids_of(tokenizer, *tokens: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(list(tokens))


# ------------------------------------------------------------------ tokens as bytes
def test_byte_level_tokens_are_their_bytes(mapping, default_model_tokenizer):
    t = mapping.target
    world, half = ids_of(default_model_tokenizer, "Ġworld", "ä½")   # 'ä½': 0xE4 0xBD, the start of '你'
    assert t.pieces[world] == b" world" and t.kinds[world] == TEXT
    assert t.pieces[half] == b"\xe4\xbd"                              # half a character: bytes, not U+FFFD
    end = default_model_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert t.kinds[end] == SPECIAL and t.pieces[end] is None and t.special[end] == "<|im_end|>"


def test_sentencepiece_tokens_are_their_bytes(mapping, draft_tokenizer):
    d = mapping.draft
    [byte_e4] = ids_of(draft_tokenizer, "<0xE4>")
    assert d.pieces[byte_e4] == b"\xe4" and d.kinds[byte_e4] == BYTE
    spaced = next(i for i, p in enumerate(draft_tokenizer.convert_ids_to_tokens(list(range(len(draft_tokenizer)))))
                  if p.startswith("▁") and len(p) > 3)
    assert d.pieces[spaced] == draft_tokenizer.convert_ids_to_tokens(spaced).replace("▁", " ").encode()
    bos = draft_tokenizer.bos_token_id
    assert d.kinds[bos] == SPECIAL and d.pieces[bos] is None
    assert mapping.draft_bos == bos                     # its tokenizer starts texts with a BOS


def test_added_tokens_that_are_not_special_are_text(default_model_tokenizer):
    tok = sentencepiece_style()
    tok.add_tokens(["<table>"])                          # as Gemma's '<table>', '\n\n', ...
    table = TokenTable.from_tokenizer(tok, len(tok))
    i = tok.convert_tokens_to_ids("<table>")
    assert table.kinds[i] == TEXT and table.pieces[i] == b"<table>"


def _random_bytes(rng: random.Random) -> bytes:
    parts = ["the", " quick", " 你好", "é", "🙂", "\n\n  ", "<|im_end|>", "<eos>", "def f(x):\n    return x", "12,345"]
    out = b""
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.25:
            out += bytes(rng.randrange(256) for _ in range(rng.randint(1, 3)))   # invalid UTF-8 too
        else:
            out += rng.choice(parts).encode()
    return out


def test_bytes_back_to_tokens_exactly(texts, mapping):
    """Whatever the bytes (half characters, invalid UTF-8, a special token's string as text),
    the tokens spell them exactly and are never special tokens; only bytes the vocabulary has
    no token for are left out (the default model lacks 21 that UTF-8 never uses, such as 0xF8)."""
    rng = random.Random(0)
    assert mapping.target.byte_ids[0xF8] is None and all(i is not None for i in mapping.draft.byte_ids)
    for text, table in zip(texts, (mapping.target, mapping.draft)):
        for _ in range(300):
            data = _random_bytes(rng)
            spans = text.spans(data)
            assert all(table.kinds[i] in (TEXT, BYTE) for i, _ in spans)
            at = 0
            for i, end in spans:                   # each token spells its span; between them only
                start = end - len(table.pieces[i])  # bytes the vocabulary has no token for
                assert data[start:end] == table.pieces[i]
                assert start >= at and all(table.byte_ids[b] is None for b in data[at:start])
                at = end
            assert all(table.byte_ids[b] is None for b in data[at:])
    with pytest.raises(ValueError, match="cannot spell"):
        texts[0].encode(b"ok \xf8")


def test_text_is_tokenized_by_the_tokenizer(texts, default_model_tokenizer, draft_tokenizer):
    target_text, draft_text = texts
    assert target_text.encode(b" hello world") == default_model_tokenizer.encode(" hello world")
    assert draft_text.encode(b"The quick brown fox") == draft_tokenizer.encode("The quick brown fox",
                                                                              add_special_tokens=False)


# ------------------------------------------------------------------ the mapping and its cache
def test_twins_by_bytes_and_specials_by_string_then_eos(mapping, default_model_tokenizer, draft_tokenizer):
    t, d = default_model_tokenizer, draft_tokenizer
    (space_the,) = ids_of(t, "Ġthe") if "▁the" in d.get_vocab() else (None,)
    if space_the is not None:
        assert mapping.target_to_draft[space_the] == d.convert_tokens_to_ids("▁the")
    a_plain, a_byte = ids_of(d, "a", "<0x61>")
    assert mapping.draft_to_target[a_plain] == t.convert_tokens_to_ids("a")
    assert mapping.draft_to_target[a_byte] == -1                     # one to one: the plain piece is the twin
    assert mapping.draft_to_target[d.convert_tokens_to_ids("<|im_start|>")] == t.convert_tokens_to_ids("<|im_start|>")
    assert mapping.draft_to_target[d.eos_token_id] == t.eos_token_id   # <eos> and <|im_end|>: the EOS pair
    assert mapping.draft_to_target[d.bos_token_id] == -1              # never paired by role
    pairs = [(dd, tt) for dd, tt in enumerate(mapping.draft_to_target) if tt >= 0]
    assert all(mapping.target_to_draft[tt] == dd for dd, tt in pairs)
    assert len({tt for _, tt in pairs}) == len(pairs)


def test_mapping_cached_by_both_tokenizers(tmp_path, monkeypatch, default_model_tokenizer, draft_tokenizer):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    first = vocab_mapping(default_model_tokenizer, 49152, draft_tokenizer, len(draft_tokenizer))
    files = list((tmp_path / "vocab_maps").iterdir())
    assert len(files) == 1
    target_key = vocab_map.tokenizer_key(default_model_tokenizer, 49152)
    draft_key = vocab_map.tokenizer_key(draft_tokenizer, len(draft_tokenizer))
    assert target_key in files[0].name and draft_key in files[0].name

    def not_again(*args):
        raise AssertionError("computed again instead of read from the cache")

    monkeypatch.setattr(TokenTable, "from_tokenizer", not_again)
    again = vocab_mapping(default_model_tokenizer, 49152, draft_tokenizer, len(draft_tokenizer))
    assert again.draft_to_target == first.draft_to_target and again.target.pieces == first.target.pieces
    assert again.draft.special == first.draft.special and again.draft_bos == first.draft_bos
    monkeypatch.undo()
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    other = sentencepiece_style(vocab_size=400)                      # another draft tokenizer: another file
    vocab_mapping(default_model_tokenizer, 49152, other, len(other))
    assert len(list((tmp_path / "vocab_maps").iterdir())) == 2


def test_same_tokenizer_is_identical(tmp_path, monkeypatch, default_model_tokenizer):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    same = vocab_mapping(default_model_tokenizer, 49152, default_model_tokenizer, 49152)
    assert same.identical and same.draft_to_target == list(range(49152))
    padded = vocab_mapping(default_model_tokenizer, 49152, default_model_tokenizer, 49152 + 64)
    assert padded.same_tokens and not padded.identical


def test_no_usable_overlap_is_a_clear_error(tmp_path, monkeypatch, default_model_tokenizer):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    tok = disjoint()
    with pytest.raises(NoUsableOverlapError, match="shares 0 of its 64 text tokens") as e:
        vocab_mapping(default_model_tokenizer, 49152, tok, len(tok), "words")
    assert isinstance(e.value, VocabularyMismatchError) and "'words'" in str(e.value)


# ------------------------------------------------------------------ one request's draft reading
def spelled(seq: DraftSequence, mapping) -> list[int]:
    """The draft's reading as symbols (its BOS left out)."""
    out = []
    for i in seq.ids[seq.fixed :]:
        out += draft_symbols(mapping, i)
    return out


def target_text_without_untwinned_specials(seq: DraftSequence, mapping) -> list[int]:
    return [s for s in seq.symbols if s < SPECIAL_BASE or mapping.target_to_draft[s - SPECIAL_BASE] >= 0]


def check_reading(seq: DraftSequence, mapping) -> None:
    assert spelled(seq, mapping) == target_text_without_untwinned_specials(seq, mapping)
    ends = seq.ends[seq.fixed :]
    assert ends == sorted(ends) and (not ends or ends[-1] <= len(seq.symbols))
    assert seq.num_computed <= len(seq.ids)


def new_sequence(mapping, texts) -> DraftSequence:
    return DraftSequence(mapping, texts[1])


def test_reading_the_prompt(mapping, texts, default_model_tokenizer, draft_tokenizer):
    seq = new_sequence(mapping, texts)
    prompt = default_model_tokenizer.encode("The quick brown fox, café 你好")
    seq.sync(prompt)
    assert seq.ids[0] == draft_tokenizer.bos_token_id and seq.fixed == 1
    assert seq.ids[1:] == draft_tokenizer.encode("The quick brown fox, café 你好", add_special_tokens=False)
    check_reading(seq, mapping)


def test_drafts_kept_up_to_the_common_prefix(mapping, texts, default_model_tokenizer, draft_tokenizer):
    """The draft guessed ' jumps over the'; the target wrote ' jumps under'. Its tokens within
    ' jumps ' stay (less the last, read again), the others go, its cache rolls back to them."""
    tok = default_model_tokenizer
    seq = new_sequence(mapping, texts)
    seq.sync(tok.encode("The quick brown fox"))
    seq.num_computed = len(seq.ids)
    before = list(seq.ids)
    for d in draft_tokenizer.encode(" jumps over the", add_special_tokens=False):
        seq.push_draft(d, draft_symbols(mapping, d))
    seq.num_computed = len(seq.ids) - 1                    # every draft but the last was fed
    seq.sync(tok.encode("The quick brown fox jumps under"))
    check_reading(seq, mapping)
    kept = len(before) - 1                                   # the prompt's last token read again
    assert seq.ids[:kept] == before[:kept] and seq.num_computed >= kept
    assert seq.num_computed <= common_length(seq.ids, before + draft_tokenizer.encode(" jumps over the",
                                                                                      add_special_tokens=False))


def common_length(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_two_draft_tokens_make_one_target_token_and_back(mapping, texts, default_model_tokenizer, draft_tokenizer):
    """Text is read in the draft's own tokens whatever the target's split ('add' is one target
    token and two draft pieces; a draft piece 'i▁' spans two target tokens): each time the
    target writes on, the draft keeps its tokens but the last and reads the rest again."""
    tok = default_model_tokenizer
    seq = new_sequence(mapping, texts)
    text, tokens = "", []
    for piece in ["def", " add", "(a", ", b", "):\n", "    return", " a", " +", " b", "\n", "Hi", " quick"]:
        before = list(seq.ids)
        text += piece
        tokens += tok.encode(piece)                 # the target's tokens only ever grow
        seq.sync(tokens)
        check_reading(seq, mapping)
        kept = max(seq.fixed, len(before) - 1)
        assert seq.ids[:kept] == before[:kept]
        start = seq.ends[kept - 1] if kept > seq.fixed else 0
        assert seq.ids[kept:] == draft_tokenizer.encode(text.encode()[start:].decode(), add_special_tokens=False)


def test_half_characters_read_again_whole(mapping, texts, default_model_tokenizer, draft_tokenizer):
    """The target writes '你' as two byte-level tokens: the draft reads the first half as byte
    pieces, then, once the character is whole, as the character (no <0xNN> left)."""
    tok = default_model_tokenizer
    seq = new_sequence(mapping, texts)
    halves = tok.convert_tokens_to_ids(["ä½", "ł"])          # 0xE4 0xBD | 0xA0 = '你'
    seq.sync(tok.encode("Hi ") + halves[:1])
    check_reading(seq, mapping)
    assert mapping.draft.kinds[seq.ids[-1]] == BYTE
    seq.num_computed = len(seq.ids)
    seq.sync(tok.encode("Hi ") + halves)
    check_reading(seq, mapping)
    assert seq.ids[1:] == draft_tokenizer.encode("Hi 你", add_special_tokens=False)
    assert draft_tokenizer.convert_ids_to_tokens(seq.ids[-1]) == "你"


def test_special_tokens_read_as_twins_or_not_at_all(mapping, texts, default_model_tokenizer, draft_tokenizer):
    tok = default_model_tokenizer
    seq = new_sequence(mapping, texts)
    start, end, repo = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<repo_name>"])
    seq.sync([start] + tok.encode("user\nHi") + [end, repo] + tok.encode("\nok"))
    check_reading(seq, mapping)
    assert draft_tokenizer.convert_tokens_to_ids("<|im_start|>") in seq.ids
    assert draft_tokenizer.eos_token_id in seq.ids            # <|im_end|>'s twin; <repo_name> has none
    assert target_symbols(mapping, repo) == [SPECIAL_BASE + repo]


def test_twins_mode_reads_the_targets_tokens(tmp_path, monkeypatch, default_model_tokenizer):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    same = vocab_mapping(default_model_tokenizer, 49152, default_model_tokenizer, 49152)
    seq = DraftSequence(same, TokenText(default_model_tokenizer, same.draft), twins=True)
    tokens = default_model_tokenizer.convert_tokens_to_ids(["H", "el", "lo", "Ġwor", "ld"])   # not canonical
    seq.sync(tokens)
    assert seq.ids == tokens
    seq.num_computed = len(tokens)
    seq.push_draft(tokens[1], draft_symbols(same, tokens[1]))   # drafted 'el', the target wrote 'el' then '!'
    seq.sync(tokens + tokens[1:2] + default_model_tokenizer.convert_tokens_to_ids(["!"]))
    assert seq.ids == tokens + tokens[1:2] + default_model_tokenizer.convert_tokens_to_ids(["!"])
    assert seq.num_computed == len(tokens)


# ------------------------------------------------------------------ SLEM's proposals
def test_slem_holds_the_last_target_token_back(texts, default_model_tokenizer):
    target_text = texts[0]
    tok = default_model_tokenizer
    drafted = list(b" the quick bro")
    assert slem_tokens(drafted, False, target_text) == tok.encode(" the quick")      # ' bro' may become ' brown'
    assert slem_tokens(drafted, True, target_text) == tok.encode(" the quick bro")
    eos = tok.eos_token_id
    assert slem_tokens(list(b" the end") + [SPECIAL_BASE + eos], False, target_text) == tok.encode(" the end") + [eos]
    # a byte the target has no token for ends the text it can verify (what precedes it is complete)
    assert slem_tokens(list(b" the end\xf8 more"), False, target_text) == tok.encode(" the end")
