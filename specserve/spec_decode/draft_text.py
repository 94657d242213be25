"""One request's text as its target wrote it and as a draft with another tokenizer reads it.

The target's tokens become **symbols**: the bytes of each text token (0..255), and one
symbol ``SPECIAL_BASE + id`` for each special token (which has no bytes). The draft reads
the same symbols in its own tokens (``ids``), and its KV cache holds the first
``num_computed`` of them; ``ends[i]`` is where draft token i ends in the draft's text.

After a verification step the target has appended its accepted drafts and one token of its
own. ``sync`` then brings the draft's tokens in line with the target's text:

1. the draft's text (what it read, then what it drafted) and the target's text share a
   prefix of L symbols; draft tokens that end within it stay, the rest go;
2. the last kept token goes too (and any before it that end inside a UTF-8 character),
   so that the text from there is read again in the draft's own tokenization: the
   draft had ``Hel`` + ``lo`` where it would read ``Hello``;
3. the rest of the target's text is tokenized for the draft (``TokenText.spans``): runs of
   bytes with the draft's tokenizer, a special token as the draft's twin of it
   (``VocabMapping``), or not at all where it has none (nor a byte the draft cannot spell).

``num_computed`` drops to the kept tokens, so the draft's cache is rolled back to the common
prefix of draft tokens, and its next forward computes the rest (the position of each token
is its index in ``ids``: the cache's slots are overwritten, nothing is copied).

With identical vocabularies (``twins``, the cross-vocabulary path forced on a same-vocabulary
draft) step 2 is skipped and step 3 takes each target token's twin, so the draft reads
exactly the target's tokens, as the same-vocabulary draft model does.
"""
from __future__ import annotations

import bisect
import copy
from collections.abc import Sequence

from specserve.spec_decode.token_table import TokenText
from specserve.spec_decode.vocab_map import VocabMapping

SPECIAL_BASE = 256   # symbols below are bytes; SPECIAL_BASE + t is the target's special (non-text) token t


def target_symbols(mapping: VocabMapping, token: int) -> list[int]:
    piece = mapping.target.pieces[token]
    return list(piece) if piece is not None else [SPECIAL_BASE + token]


def draft_symbols(mapping: VocabMapping, token: int) -> list[int] | None:
    """A draft token's symbols, in the target's terms; None for a special token the target has no
    twin of (the draft's text ends there)."""
    piece = mapping.draft.pieces[token]
    if piece is not None:
        return list(piece)
    twin = mapping.draft_to_target[token]
    return [SPECIAL_BASE + twin] if twin >= 0 else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftSequence:
    """The draft's reading of one request's text (module docstring)."""

    def __init__(self, mapping: VocabMapping, draft_text: TokenText, twins: bool = False):
        self.mapping = mapping
        self.draft_text = draft_text
        self.twins = twins
        prefix = [mapping.draft_bos] if mapping.draft_bos is not None else []
        self.symbols: list[int] = []          # the target's text
        self.target_ends: list[int] = []      # where each target token ends in ``symbols``
        self.ids: list[int] = list(prefix)    # the draft's tokens: its reading, then its last drafts
        self.ends: list[int] = [0] * len(prefix)
        self.fixed = len(prefix)              # the draft's BOS, never dropped
        self.num_computed = 0                 # ids with K/V in the draft's cache
        self.base = 0                         # len(symbols) when the last drafts were made
        self.drafted: list[int] = []          # their symbols: the draft's guess of the text after ``base``

    def copy(self) -> "DraftSequence":
        """Another request's reading that starts as this one (a forked beam): its own lists, the
        mapping and token tables shared."""
        other = copy.copy(self)
        for name in ("symbols", "target_ends", "ids", "ends", "drafted"):
            setattr(other, name, list(getattr(self, name)))
        return other

    # ------------------------------------------------------------------ the target's side
    def sync(self, target_token_ids: Sequence[int]) -> None:
        """Catch up with the target's tokens (a request's prompt and output so far: they only grow)."""
        first_new = len(self.target_ends)
        if first_new == 0 and self.fixed and target_token_ids and self._twin_of(target_token_ids[0]) == self.ids[0]:
            self.ids, self.ends, self.fixed = [], [], 0   # the target's own BOS maps onto the draft's
        for t in target_token_ids[first_new:]:
            self.symbols += target_symbols(self.mapping, t)
            self.target_ends.append(len(self.symbols))
        if self.drafted:
            agreed = self.base + common_prefix(self.symbols[self.base :], self.drafted)
        else:
            agreed = self.ends[-1] if self.ends else 0
        n = self.fixed
        while n < len(self.ids) and self.ends[n] <= agreed:
            n += 1
        covered = self.ends[n - 1] if n else 0
        if not self.twins and covered < len(self.symbols):
            n = self._back_off(n)
            covered = self.ends[n - 1] if n else 0
        del self.ids[n:], self.ends[n:]
        self.num_computed = min(self.num_computed, n)
        self._read(covered, target_token_ids)
        self.base, self.drafted = len(self.symbols), []

    def _back_off(self, n: int) -> int:
        """Drop the last kept token, then any that end inside a UTF-8 character (the next
        symbol a continuation byte), so the text after them is read again whole."""
        if n > self.fixed:
            n -= 1
        while n > self.fixed and 0x80 <= self._symbol_at(self.ends[n - 1]) < 0xC0:
            n -= 1
        return n

    def _symbol_at(self, i: int) -> int:
        return self.symbols[i] if i < len(self.symbols) else -1

    def _twin_of(self, target_token: int) -> int:
        return self.mapping.target_to_draft[target_token]

    def _read(self, covered: int, target_token_ids: Sequence[int]) -> None:
        """Append the draft's tokens for ``symbols[covered:]`` (module docstring, step 3)."""
        if self.twins:
            at = _first_token_at(self.target_ends, covered)
            if at is not None:
                self._read_twins(target_token_ids, at)
                return
        run_start = covered
        for i in range(covered, len(self.symbols) + 1):
            s = self.symbols[i] if i < len(self.symbols) else None
            if s is not None and s < SPECIAL_BASE:
                continue
            self._read_bytes(run_start, i)
            if s is not None:
                twin = self._twin_of(s - SPECIAL_BASE)
                if twin >= 0:
                    self.ids.append(twin)
                    self.ends.append(i + 1)
            run_start = i + 1

    def _read_twins(self, target_token_ids: Sequence[int], first: int) -> None:
        for token, end in zip(target_token_ids[first:], self.target_ends[first:]):
            twin = self._twin_of(token)
            if twin >= 0:
                self.ids.append(twin)
                self.ends.append(end)

    def _read_bytes(self, start: int, stop: int) -> None:
        if stop <= start:
            return
        for token, end in self.draft_text.spans(bytes(self.symbols[start:stop])):
            self.ids.append(token)
            self.ends.append(start + end)

    # ------------------------------------------------------------------ the draft's side
    def push_draft(self, token: int, symbols: list[int]) -> None:
        """A drafted token (fed to the draft's cache by the next draft step) and its symbols."""
        self.drafted += symbols
        self.ids.append(token)
        self.ends.append(self.base + len(self.drafted))


def _first_token_at(ends: list[int], offset: int) -> int | None:
    """The index of the target token that starts at symbol ``offset`` (None: mid-token)."""
    if offset == 0:
        return 0
    i = bisect.bisect_left(ends, offset)
    return i + 1 if i < len(ends) and ends[i] == offset else None
