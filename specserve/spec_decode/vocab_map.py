"""The mapping between a draft's vocabulary and its target's, by strings, cached on disk.

Two token ids correspond when they spell the same bytes (``token_table``: byte-level BPE
and SentencePiece-style pieces both read as bytes), one to one: where a vocabulary holds
several ids of the same bytes (a SentencePiece vocabulary's ``a`` and ``<0x61>``) the
canonical one takes part (the plain piece, then the lowest id). Special tokens never
correspond as text; they pair by their strings (ChatML's ``<|im_end|>`` in SmolLM2 and Qwen),
then the draft's EOS with the target's EOS (a draft that ends its text proposes the target's
end). BOS is not paired by role: SmolLM2's "BOS" is ``<|im_start|>``, which opens every chat
turn; a draft whose tokenizer starts texts with a BOS gets its own BOS before the text
(``VocabMapping.draft_bos``).

The mapping and both token tables are computed once and kept in
``$SPECSERVE_CACHE_DIR/vocab_maps/`` (the catalog's cache root), in a file named after both
tokenizers: a SHA-256 of each one's serialized ``tokenizers`` JSON and its BOS/EOS ids, and
both vocabulary sizes. Reading Gemma 3's 262,144-token vocabulary and pairing it with
SmolLM2's takes seconds; the cached file loads in a fraction of that.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from specserve import catalog
from specserve.spec_decode.token_table import BYTE, SPECIAL, TEXT, UNKNOWN, TokenTable, canonical_ids

logger = logging.getLogger(__name__)

MAPPING_VERSION = 1          # bumped whenever what is cached changes
# A draft shares too little with its target when fewer than this share of its text tokens have
# a twin: its drafts could hardly be verified (docs/speculative_decoding.md, "Drafts with another
# tokenizer").
MIN_SHARED_FRACTION = 0.01


class VocabularyMismatchError(ValueError):
    """A draft whose vocabulary does not fit its target (``checks`` re-exports it)."""


class NoUsableOverlapError(VocabularyMismatchError):
    """A draft with another tokenizer that shares too little text with its target."""


@dataclass
class VocabMapping:
    """Which draft id is which target id (-1: none), both tables, and the tokenizers' roles."""

    target: TokenTable
    draft: TokenTable
    draft_to_target: list[int]      # [V_draft]: the target's twin of each draft id, or -1
    target_to_draft: list[int]      # [V_target]: the inverse, or -1
    draft_bos: int | None           # the draft's BOS where its tokenizer starts a text with one, else None

    @property
    def num_shared(self) -> int:
        return sum(1 for t in self.draft_to_target if t >= 0)

    @property
    def same_tokens(self) -> bool:
        """Every id spells the same text (or is the same special) in both vocabularies; ids that
        only one of them has are no token (padding rows of a model's vocabulary)."""
        t, d = self.target, self.draft
        n = min(t.size, d.size)
        return t.kinds[:n] == d.kinds[:n] and t.pieces[:n] == d.pieces[:n] and t.special == d.special \
            and all(k == UNKNOWN for k in t.kinds[n:]) and all(k == UNKNOWN for k in d.kinds[n:])

    @property
    def identical(self) -> bool:
        """The same tokens and the same vocabulary size: the draft fits as a same-vocabulary draft."""
        return self.target.size == self.draft.size and self.same_tokens


def pair_vocabularies(target: TokenTable, draft: TokenTable, target_roles: dict[str, int | None],
                      draft_roles: dict[str, int | None]) -> tuple[list[int], list[int]]:
    """-> (draft_to_target, target_to_draft): text twins by bytes, specials by string, then the
    EOS ids (``*_roles``: {"eos": id}, None where the tokenizer has none)."""
    d2t, t2d = [-1] * draft.size, [-1] * target.size
    target_ids = canonical_ids(target.pieces, target.kinds)
    for piece, d in canonical_ids(draft.pieces, draft.kinds).items():
        t = target_ids.get(piece)
        if t is not None:
            d2t[d], t2d[t] = t, d
    target_special = {s: i for i, s in sorted(target.special.items(), reverse=True)}   # lowest id wins
    for d, s in sorted(draft.special.items()):
        t = target_special.get(s)
        if t is not None and t2d[t] < 0:
            d2t[d], t2d[t] = t, d
    d, t = draft_roles.get("eos"), target_roles.get("eos")
    if d is not None and t is not None and d < draft.size and t < target.size and d2t[d] < 0 and t2d[t] < 0 \
            and draft.kinds[d] == SPECIAL and target.kinds[t] == SPECIAL:
        d2t[d], t2d[t] = t, d
    return d2t, t2d


def roles(tokenizer) -> dict[str, int | None]:
    return {"eos": tokenizer.eos_token_id}


def starts_with_bos(tokenizer) -> int | None:
    """The BOS id if the tokenizer puts one before a text (Gemma's does, SmolLM2's does not)."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer.encode("a")[:1] == [bos] else None


def tokenizer_key(tokenizer, size: int) -> str:
    """What names a tokenizer in the cache: its serialized ``tokenizers`` JSON, its BOS and EOS
    (they live outside that JSON) and the vocabulary size the model gives it."""
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    h.update(f"|{tokenizer.bos_token_id}|{tokenizer.eos_token_id}|{size}".encode())
    return h.hexdigest()[:24]


def vocab_mapping(target_tokenizer, target_size: int, draft_tokenizer, draft_size: int,
                  draft_name: str = "the draft") -> VocabMapping:
    """The mapping of two tokenizers (from the cache, else computed and cached); raises
    ``NoUsableOverlapError`` when the draft shares too little text with the target."""
    path = os.path.join(catalog.cache_root(), "vocab_maps",
                        f"v{MAPPING_VERSION}-{tokenizer_key(target_tokenizer, target_size)}-"
                        f"{tokenizer_key(draft_tokenizer, draft_size)}.npz")
    mapping = _load(path)
    if mapping is None:
        target = TokenTable.from_tokenizer(target_tokenizer, target_size)
        draft = TokenTable.from_tokenizer(draft_tokenizer, draft_size)
        d2t, t2d = pair_vocabularies(target, draft, roles(target_tokenizer), roles(draft_tokenizer))
        mapping = VocabMapping(target, draft, d2t, t2d, starts_with_bos(draft_tokenizer))
        _save(path, mapping)
    check_overlap(mapping, draft_name)
    return mapping


def check_overlap(mapping: VocabMapping, draft_name: str) -> None:
    draft_text = sum(1 for k in mapping.draft.kinds if k in (TEXT, BYTE))
    shared = sum(1 for d, t in enumerate(mapping.draft_to_target) if t >= 0 and mapping.draft.kinds[d] != SPECIAL)
    if draft_text == 0 or shared < max(1, MIN_SHARED_FRACTION * draft_text):
        raise NoUsableOverlapError(
            f"the draft {draft_name!r} shares {shared} of its {draft_text} text tokens with the target's vocabulary "
            f"({mapping.target.size} tokens); drafting across vocabularies needs at least "
            f"{MIN_SHARED_FRACTION:.0%} of them spelled the same: use a draft whose tokenizer covers the "
            "target's text (docs/speculative_decoding.md, \"Drafts with another tokenizer\")"
        )


# --------------------------------------------------------------------------- the cache file
def _table_arrays(prefix: str, table: TokenTable) -> dict[str, np.ndarray]:
    """A table as arrays: each id's bytes (a special's string) in one blob, offsets, kinds."""
    parts = [table.pieces[i] if table.pieces[i] is not None else table.special.get(i, "").encode("utf-8")
             for i in range(table.size)]
    offsets = np.zeros(table.size + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    return {f"{prefix}_blob": np.frombuffer(b"".join(parts), dtype=np.uint8),
            f"{prefix}_offsets": offsets, f"{prefix}_kinds": np.asarray(table.kinds, dtype=np.int8)}


def _table_from(arrays, prefix: str) -> TokenTable:
    blob = arrays[f"{prefix}_blob"].tobytes()
    offsets = arrays[f"{prefix}_offsets"].tolist()
    kinds = arrays[f"{prefix}_kinds"].tolist()
    pieces: list[bytes | None] = [None] * len(kinds)
    special: dict[int, str] = {}
    for i, kind in enumerate(kinds):
        if kind in (TEXT, BYTE):
            pieces[i] = blob[offsets[i] : offsets[i + 1]]
        elif kind == SPECIAL:
            special[i] = blob[offsets[i] : offsets[i + 1]].decode("utf-8")
    return TokenTable(len(kinds), pieces, kinds, special)


def _save(path: str, mapping: VocabMapping) -> None:
    """Written to a temporary file and renamed into place: a reader never sees half a file."""
    arrays = {**_table_arrays("target", mapping.target), **_table_arrays("draft", mapping.draft),
              "draft_to_target": np.asarray(mapping.draft_to_target, dtype=np.int64),
              "target_to_draft": np.asarray(mapping.target_to_draft, dtype=np.int64),
              "draft_bos": np.asarray(-1 if mapping.draft_bos is None else mapping.draft_bos, dtype=np.int64)}
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError as e:   # a read-only cache only costs the next start the computation
        logger.warning("could not cache the vocabulary mapping in %s: %s", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def _load(path: str) -> VocabMapping | None:
    try:
        with np.load(path) as arrays:
            bos = int(arrays["draft_bos"])
            return VocabMapping(_table_from(arrays, "target"), _table_from(arrays, "draft"),
                                arrays["draft_to_target"].tolist(), arrays["target_to_draft"].tolist(),
                                None if bos < 0 else bos)
    except (OSError, KeyError, ValueError) as e:
        if not isinstance(e, FileNotFoundError):
            logger.warning("ignoring the unreadable vocabulary mapping %s: %s", path, e)
        return None
