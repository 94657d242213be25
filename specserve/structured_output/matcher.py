"""One request's grammar state: advanced by emitted tokens only; drafts are walked and rolled back.

The matcher (llguidance's ``LLMatcher``) always stands after the request's output so far.
Everything speculative happens on top of it and is undone before the call returns: checking
drafts (``valid_prefix``, ``prune_tree``), the masks of the states after draft prefixes
(``mask_after``: consume the prefix, compute the mask, roll back) and the grammar's forced
continuation (``forced_after``). Only ``advance``, with the tokens a step appended, moves it
for good. So a rejected draft never leaves a trace, a step verified again after a failure
sees the same masks, and a preempted request (recomputed from its tokens) needs nothing
rebuilt: its output, which the matcher stands after, is kept.

llguidance matchers enter an error state for good on an invalid token, so drafts are checked
with ``validate_tokens`` (which moves nothing) before any is consumed. The end-of-sequence
token is never consumed: a matcher that has stopped takes it without counting it as a step,
so rolling back over it would undo one token too many. Nothing can follow it in a draft, and
the state after it allows only itself.
"""
from __future__ import annotations

import torch

from specserve.structured_output.bitmask import words_for


class GrammarStateError(RuntimeError):
    """The matcher refused a token the masks allowed: a bug, so the request fails alone ("error")."""


class GrammarLimitError(GrammarStateError):
    """The grammar ran out of one of its limits (GrammarLimits: lexer states, fuel per step)
    while the request ran: it cannot be continued within its bounds, so the request ends as it
    would at max_tokens, finish_reason "length" (engine/constraints.py)."""


def _grammar_error(matcher, what: str) -> GrammarStateError:
    message = matcher.get_error()
    cls = GrammarStateError if "doesn't satisfy the grammar" in message else GrammarLimitError
    return cls(f"{what}: {message.split(chr(10) + '<')[0][:300]}")


class RequestGrammar:
    def __init__(self, matcher, vocab_size: int, eos_token_id: int | None):
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}   # draft prefix -> mask [W], this step's
        # This step's verification masks, one row per verified row (the last token, then each
        # draft): row i is the state after the drafts before row i. Set by the engine before
        # the forward; the verifier applies it.
        self.step_bitmask: torch.Tensor | None = None           # [n + 1, W] int32
        # Set when preparing this step's masks failed (a limit ran out): the verifier raises it,
        # so the request fails alone (finish_reason "error") and the batch carries on.
        self.failed: Exception | None = None
        self.exhausted = False    # a limit ran out (GrammarLimitError): the request ends, "length"
        # This step's rows before they are computed (structured_output.step_masks):
        # ("chain", drafts, rows repeated after them) or ("tree", each node's path).
        self.row_plan: tuple | None = None

    @property
    def matcher(self):
        """llguidance's LLMatcher, for batched mask calls (step_masks); it stands after the output."""
        return self._m

    # ------------------------------------------------------------------ state
    @property
    def is_done(self) -> bool:
        """Nothing but the end of sequence can follow: the constraint is complete."""
        return self._m.is_stopped()

    def advance(self, tokens: list[int]) -> None:
        """The step's appended tokens; raises GrammarStateError if one breaks the grammar."""
        self._masks.clear()
        self.step_bitmask, self.failed, self.row_plan = None, None, None
        for t in tokens[: self._through_eos(tokens)]:
            if t == self.eos_token_id:
                if not self._m.is_accepting():
                    raise GrammarStateError("the end of sequence came before the constraint was complete")
                return
            if not self._m.consume_token(t):
                raise _grammar_error(self._m, f"token {t} could not be added to the request's grammar")

    def _through_eos(self, tokens) -> int:
        """How many of ``tokens`` come up to and including the first end of sequence."""
        eos = self.eos_token_id
        return next((i + 1 for i, t in enumerate(tokens) if t == eos), len(tokens))

    def end_at_limit(self, error: GrammarLimitError, rows: int = 1) -> None:
        """A limit ran out while preparing this step: the request ends here. With an end of
        sequence, ``rows`` verification masks allow only it (finish_reason "length" follows);
        without one, it fails alone (``failed``, raised by the verifier)."""
        if self.eos_token_id is None:
            self.failed = error
            return
        self.exhausted = True
        self.step_bitmask = eos_only_mask(self.vocab_size, self.eos_token_id).expand(rows, -1).clone()

    # ------------------------------------------------------- the step's rows
    def plan_chain_rows(self, chain: list[int], repeat_last: int = 0) -> None:
        """The step verifies ``chain`` (checked drafts) and ``repeat_last`` drafts after them that
        are certainly rejected: rows are the states after ``chain[:j]``, j = 0..len(chain), then
        the last one again ``repeat_last`` times (the row after a certainly rejected draft is
        never sampled)."""
        self.step_bitmask = None
        self.row_plan = ("chain", list(chain), repeat_last)

    def plan_tree_rows(self, paths: list[list[int]]) -> None:
        """The step verifies a tree whose node i has the path ``paths[i]`` (its ancestors' tokens
        and its own): rows are the root's state, then the state after each path."""
        self.step_bitmask = None
        self.row_plan = ("tree", paths)

    def planned_row_count(self) -> int:
        kind, body, *rest = self.row_plan
        return len(body) + 1 + (rest[0] if kind == "chain" else 0)

    def set_planned_rows(self, rows: torch.Tensor) -> None:
        """``rows`` [r, W]: the masks of the planned states (for a chain that ends with the end of
        sequence, the state after it may be left out: it allows only the end again) -> sets
        ``step_bitmask`` [planned_row_count(), W]."""
        kind, body, *rest = self.row_plan
        if kind == "chain":
            if rows.shape[0] == len(body):          # the chain ends with the end of sequence
                rows = torch.cat([rows, eos_only_mask(self.vocab_size, self.eos_token_id)])
            if rest[0]:
                rows = torch.cat([rows, rows[-1:].expand(rest[0], -1)])
        if rows.shape[0] != self.planned_row_count():
            raise RuntimeError(f"{rows.shape[0]} grammar masks for {self.planned_row_count()} planned rows")
        self.step_bitmask = rows.contiguous()

    # ----------------------------------------------------------- speculation
    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from the current state (moves nothing)."""
        upto = self._through_eos(tokens)
        return self._m.validate_tokens(list(tokens[:upto])) if upto else 0

    def mask_after(self, prefix: list[int] | tuple[int, ...]) -> torch.Tensor:
        """The bitmask [W] of the state after ``prefix`` (tokens the grammar accepts), cached
        for the step: the draft model's masks are the verifier's first rows."""
        key = tuple(prefix)
        mask = self._masks.get(key)
        if mask is None:
            import llguidance.torch as llt

            if key and key[-1] == self.eos_token_id:   # the sequence has ended: only the end again
                mask = eos_only_mask(self.vocab_size, self.eos_token_id)
            else:
                mask = torch.zeros(1, words_for(self.vocab_size), dtype=torch.int32)
                self._walk(key)
                try:
                    llt.fill_next_token_bitmask(self._m, mask, 0)
                    if self._m.is_error():
                        raise _grammar_error(self._m, "the grammar's next mask failed")
                finally:
                    self._m.rollback(len(key))
            mask = self._masks[key] = mask[0]
        return mask

    def forced_after(self, prefix: list[int]) -> list[int]:
        """The tokens the grammar forces after ``prefix``: the only continuation it allows,
        tokenized (llguidance's fast-forward tokens; empty where there is a choice)."""
        if prefix and prefix[-1] == self.eos_token_id:
            return []
        self._walk(tuple(prefix))
        try:
            forced = list(self._m.compute_ff_tokens())
            if not forced and self._m.is_stopped() and self.eos_token_id is not None:
                forced = [self.eos_token_id]    # complete: the end of sequence is all that can follow
            return forced
        finally:
            self._m.rollback(len(prefix))

    def _walk(self, prefix: tuple[int, ...]) -> None:
        """Consume a checked prefix without an end of sequence (callers roll it back)."""
        for i, t in enumerate(prefix):
            if not self._m.consume_token(t):   # callers pass checked prefixes; never leave it moved
                self._m.rollback(i)
                raise GrammarStateError(f"draft token {t} was not checked against the grammar")

    def prune_tree(self, tokens: list[int], parents: list[int]) -> list[int]:
        """Indices of the tree's drafts to keep: a node stays when its parent stays and the
        grammar accepts its token after its ancestors (parents come before children)."""
        keep: list[int] = []
        paths: dict[int, list[int]] = {-1: []}
        for i, (t, p) in enumerate(zip(tokens, parents)):
            if p not in paths or (paths[p] and paths[p][-1] == self.eos_token_id):
                continue
            path = paths[p] + [t]
            if self._m.validate_tokens(path) == len(path):
                paths[i] = path
                keep.append(i)
        return keep


def eos_only_mask(vocab_size: int, eos_token_id: int) -> torch.Tensor:
    """[1, W]: only the end of sequence allowed."""
    mask = torch.zeros(1, words_for(vocab_size), dtype=torch.int32)
    mask[0, eos_token_id // 32] = _bit(eos_token_id % 32)
    return mask


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
