"""A tokenizer's tokens as bytes, and bytes back to its tokens, exactly.

Drafting across vocabularies (``cross_vocab.py``) compares texts, and a text is bytes: a
byte-level BPE token (SmolLM2, Qwen) is a string of stand-in characters, one per byte
(GPT-2's ``bytes_to_unicode``: 'Ġ' is the space byte), and may hold half of a UTF-8 character;
a SentencePiece-style token (Gemma, Llama 2) writes the space as '▁' and keeps bytes outside
its pieces as ``<0xNN>`` tokens. Decoding tokens one at a time to ``str`` would turn such half
characters into U+FFFD, so every token here is read as its exact bytes.

Special tokens (``AddedToken.special``: BOS, EOS, chat markers, Gemma's ``<unusedN>``) have no
bytes: they are never matched as text (``TokenTable.special`` holds their strings, by which
``vocab_map`` pairs them across vocabularies). Added tokens that are not special
(Gemma's ``'\\n\\n'``, ``'<table>'``) are their literal text.

``TokenText.spans`` turns bytes into this tokenizer's tokens with the tokenizer itself, and
checks that the tokens' bytes are the input's: where they are not (a literal special token
string in the text, a normalizer that rewrites characters), or where the bytes are not valid
UTF-8, it falls back to one byte token per byte, which byte-level and byte-fallback
vocabularies have, save bytes UTF-8 never uses (the default model has no 0xF8): those are
left out. The tokens thus spell the input exactly, but for such bytes.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# What an id is (``TokenTable.kinds``): text; a special token; not understood (or past the
# tokenizer's ids); a SentencePiece byte-fallback piece ``<0xNN>`` (text too, one byte).
TEXT, SPECIAL, UNKNOWN, BYTE = 0, 1, 2, 3
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ESCAPED = re.compile("([\udc80-\udcff])")   # bytes that are not UTF-8, after surrogateescape


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: stand-in character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


@dataclass
class TokenTable:
    """Every id of a vocabulary of ``size`` ids (the model's logit rows) as bytes.

    ``pieces[i]``: the bytes of text token i (TEXT or BYTE), else None; ``kinds[i]``: TEXT,
    SPECIAL, UNKNOWN (ids past the tokenizer's, pieces no decoder rule explains) or BYTE;
    ``special``: id -> the string of each special token; ``byte_ids[b]``: a token of the
    single byte b (or None)."""

    size: int
    pieces: list[bytes | None]
    kinds: list[int]
    special: dict[int, str]
    byte_ids: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.byte_ids:
            self.byte_ids = single_byte_ids(self.pieces, self.kinds)

    @classmethod
    def from_tokenizer(cls, tokenizer, size: int) -> "TokenTable":
        """Read ``tokenizer``'s vocabulary (a fast, ``tokenizers``-backed one, as the loader gives)."""
        backend = tokenizer.backend_tokenizer
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
        kind = decoder_kind(decoder)
        byte_fallback = bool(getattr(backend.model, "byte_fallback", False))
        added = backend.get_added_tokens_decoder()
        pieces: list[bytes | None] = [None] * size
        kinds = [UNKNOWN] * size
        special: dict[int, str] = {}
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if i >= size:
                continue
            a = added.get(i)
            if a is not None and a.special:
                special[i], kinds[i] = a.content, SPECIAL
                continue
            if a is not None:
                pieces[i], kinds[i] = a.content.encode("utf-8"), TEXT
            elif kind == "metaspace" and byte_fallback and (m := _BYTE_PIECE.fullmatch(token)) is not None:
                pieces[i], kinds[i] = bytes([int(m.group(1), 16)]), BYTE
            elif piece := piece_bytes(token, kind):   # (an empty piece spells nothing: left UNKNOWN)
                pieces[i], kinds[i] = piece, TEXT
        if kind is None:
            logger.warning("tokenizer %r: unknown decoder %s; its tokens are read one by one with decode()",
                           tokenizer.name_or_path, decoder.get("type"))
            for i in range(size):
                if kinds[i] == UNKNOWN and i < len(tokenizer):
                    text = tokenizer.decode([i])
                    if text and "\ufffd" not in text:
                        pieces[i], kinds[i] = text.encode("utf-8"), TEXT
        return cls(size, pieces, kinds, special)


def decoder_kind(decoder: dict) -> str | None:
    """"byte_level" (a ByteLevel decoder), "metaspace" ('▁' is the space: a Replace or a
    Metaspace decoder), or None (not understood)."""
    kinds = [decoder] + list(decoder.get("decoders") or [])
    types = {d.get("type") for d in kinds}
    if "ByteLevel" in types:
        return "byte_level"
    if "Metaspace" in types or any(d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "▁"
                                   for d in kinds):
        return "metaspace"
    return None


def piece_bytes(token: str, kind: str | None) -> bytes | None:
    """One (not byte-fallback) vocabulary entry's bytes under its tokenizer's decoder (None: not
    understood)."""
    if kind == "byte_level":
        try:
            return bytes(BYTE_LEVEL_ALPHABET[c] for c in token)
        except KeyError:
            return None
    if kind == "metaspace":
        return token.replace("▁", " ").encode("utf-8")
    return None


def canonical_ids(pieces: list[bytes | None], kinds: list[int]) -> dict[bytes, int]:
    """bytes -> the one id that stands for them: a plain piece before a ``<0xNN>`` byte-fallback
    token (the plain one is what the tokenizer itself emits), then the lowest id."""
    out: dict[bytes, int] = {}
    for wanted in (TEXT, BYTE):
        for i, piece in enumerate(pieces):
            if kinds[i] == wanted:
                out.setdefault(piece, i)
    return out


def single_byte_ids(pieces: list[bytes | None], kinds: list[int]) -> list[int | None]:
    """For each byte value, the canonical token of that byte alone (None if there is none)."""
    out: list[int | None] = [None] * 256
    for wanted in (TEXT, BYTE):
        for i, piece in enumerate(pieces):
            if kinds[i] == wanted and len(piece) == 1 and out[piece[0]] is None:
                out[piece[0]] = i
    return out


class TokenText:
    """Bytes -> one tokenizer's token ids that spell them exactly (module docstring)."""

    def __init__(self, tokenizer, table: TokenTable):
        self.table = table
        self.backend = exact_backend(tokenizer, table)

    def encode(self, data: bytes) -> list[int]:
        """The tokens that spell ``data`` exactly; ValueError for a byte the vocabulary cannot
        spell (the default model's has no token for 0xF8, which UTF-8 never uses)."""
        ids = [i for i, _ in self.spans(data)]
        if sum(len(self.table.pieces[i]) for i in ids) != len(data):   # spans only ever leave bytes out
            raise ValueError(f"the vocabulary cannot spell {data!r}")
        return ids

    def spans(self, data: bytes) -> list[tuple[int, int]]:
        """-> [(token id, where it ends in ``data``)]: the tokenizer's tokens for the valid UTF-8
        runs, one byte token for each other byte; a byte the vocabulary cannot spell is left out
        (the next token's span starts after it)."""
        if not data:
            return []
        text = data.decode("utf-8", errors="surrogateescape")
        if not _ESCAPED.search(text):
            return self._spans_of_text(text, 0)
        out: list[tuple[int, int]] = []
        at = 0
        for part in _ESCAPED.split(text):
            if len(part) == 1 and "\udc80" <= part <= "\udcff":
                at += 1
                i = self.table.byte_ids[ord(part) - 0xDC00]
                if i is not None:
                    out.append((i, at))
            elif part:
                out += self._spans_of_text(part, at)
                at += len(part.encode("utf-8"))
        return out

    def _spans_of_text(self, text: str, at: int) -> list[tuple[int, int]]:
        want = text.encode("utf-8")
        pieces = self.table.pieces
        if self.backend is not None:
            ids = self.backend.encode(text, add_special_tokens=False).ids
            if all(i < len(pieces) and pieces[i] is not None for i in ids) and b"".join(pieces[i] for i in ids) == want:
                out, end = [], at
                for i in ids:
                    end += len(pieces[i])
                    out.append((i, end))
                return out
        out = []
        for n, b in enumerate(want):   # the tokenizer did not spell it as given: byte by byte
            i = self.table.byte_ids[b]
            if i is not None:
                out.append((i, at + n + 1))
        return out


def exact_backend(tokenizer, table: TokenTable):
    """The tokenizer's ``tokenizers`` backend if it spells text as given; otherwise a private
    copy with what adds a leading space turned off (Llama 2-style ``Prepend('▁')`` normalizers,
    Metaspace's ``prepend_scheme``, ByteLevel's ``add_prefix_space``); None if even that does
    not round-trip (every text is then spelled byte by byte, correct but poor drafts)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if _round_trips(backend, table):
        return backend
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    _no_prefix_space(spec)
    copy = Tokenizer.from_str(json.dumps(spec))
    if _round_trips(copy, table):
        return copy
    logger.warning("tokenizer %r does not spell text back exactly; cross-vocabulary drafts go byte by byte",
                   tokenizer.name_or_path)
    return None


_PROBE = "Hello world, 12 + 3 = 15\n  done."


def _round_trips(backend, table: TokenTable) -> bool:
    ids = backend.encode(_PROBE, add_special_tokens=False).ids
    pieces = table.pieces
    return all(i < len(pieces) and pieces[i] is not None for i in ids) and \
        b"".join(pieces[i] for i in ids) == _PROBE.encode("utf-8")


def _no_prefix_space(node) -> None:
    """Turn off, in place, every part of a tokenizer's JSON that adds a space before the text."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace":
            node["prepend_scheme"] = "never"
            node["add_prefix_space"] = False
        if node.get("type") == "ByteLevel":
            node["add_prefix_space"] = False
        for key in ("normalizers", "pretokenizers"):
            if isinstance(node.get(key), list):
                node[key] = [n for n in node[key] if not (isinstance(n, dict) and n.get("type") == "Prepend")]
        for key, value in list(node.items()):
            if isinstance(value, dict) and value.get("type") == "Prepend":
                node[key] = None
            else:
                _no_prefix_space(value)
    elif isinstance(node, list):
        for n in node:
            _no_prefix_space(n)
