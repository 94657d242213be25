"""The engine's side of structured output: compile a request's constraint before it is queued,
give each request its own matcher, and, each step, fit the drafts to the grammar and set the
masks the verifier applies.

Per step, for every constrained request that samples (``prepare``, after drafting, before the
target's forward):

1. Drafts are checked against the grammar from the request's current state and cut at their
   first invalid token (a tree loses the branches below an invalid node). One-hot drafts
   (n-gram, suffix, forced tokens, greedy draft models) are simply cut: the target's masked
   distribution gives an invalid token probability 0, so rejecting it and sampling the
   position from the masked distribution is what verification would have done. A draft with
   a distribution q (a sampled draft model, EAGLE) keeps its first invalid token: it is
   rejected for certain, and the position is sampled from the residual of q, as rejection
   sampling requires. (Those proposers mask their own drafts, so this is rare.)
2. With ``grammar_drafts`` on, the grammar's forced continuation (llguidance's fast-forward
   tokens: where only one string can follow, tokenized) is appended as drafts, up to the
   lookahead slots the scheduler reserved: schema keys, quotes, braces and commas then cost
   one verification, not one step each. A tree gets them below its first branch.
3. The verification masks: row j is the grammar's state after the drafts before row j (its
   ancestors in a tree), including the bonus row; ``sample.verify`` applies them to the
   target's logits before any token is chosen. They are only planned here and computed by
   ``structured_output.step_masks`` in one batch, in a background thread while the target's
   forward runs (``overlap_masks``); ``wait_masks`` joins it before verification.

After the step, ``after_append`` advances the matcher by the tokens actually appended (a
stop may cut them). A complete constraint allows only the end of sequence, so the request
stops as any request does at its end of sequence (with ``ignore_eos`` too); in plain
decoding that is one more step, under speculation a forced draft. A grammar that runs out of
one of its limits (``GrammarLimits``: lexer states, fuel per mask) cannot be continued within
its bounds: the request ends there with finish_reason "length", as it would at max_tokens.
"""
from __future__ import annotations

import logging

import torch

from specserve.core.request import Request, RequestStatus
from specserve.core.scheduler import ScheduledRequest
from specserve.sampling_params import SamplingParams
from specserve.structured_output.compiler import GrammarCompiler, GrammarLimits, request_grammar
from specserve.structured_output.matcher import GrammarLimitError
from specserve.structured_output.step_masks import StepMasks

logger = logging.getLogger(__name__)


class Constraints:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, grammar_drafts: bool,
                 limits: GrammarLimits | None = None, disable_by_batch_size: int | None = None,
                 overlap_masks: bool = False):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_id, limits)
        self.grammar_drafts = grammar_drafts
        self.disable_by_batch_size = disable_by_batch_size   # SpeculativeConfig's: no forced drafts either
        self.masks = StepMasks(overlap_masks)

    def check(self, params: SamplingParams) -> None:
        """Compile the constraint (cached); raises InvalidConstraintError, a ValueError, naming
        what is wrong with it, before the request is queued."""
        if params.structured_output is not None:
            self.compiler.compile(params.structured_output)

    def attach(self, req: Request) -> None:
        """The request's own matcher, in the constraint's start state."""
        so = req.sampling_params.structured_output
        if so is not None:
            req.grammar = request_grammar(self.compiler, so)

    def prepare(self, scheduled: list[ScheduledRequest], reserved: list[int]) -> None:
        """Fit each sampling constrained request's drafts to its grammar and set its masks
        (``reserved``: each request's lookahead slots before drafting, the room for forced
        drafts). A grammar that runs out of a limit here ends its request ("length": its last
        token is the end of sequence); one that fails otherwise fails alone in verification.
        The masks are started here (``overlap_masks``: in the background) and must be waited
        for (``wait_masks``) before verification reads them."""
        self.masks.wait()     # a previous step's rows, if its forward failed before the wait
        jobs = []
        limit = self.disable_by_batch_size
        forced = self.grammar_drafts and (limit is None or sum(r > 0 for r in reserved) < limit)
        for s, room in zip(scheduled, reserved):
            req = s.request
            if req.grammar is None or not s.will_sample:
                continue
            try:
                fit_drafts(req, room if forced else 0)
                jobs.append((req.request_id, req.grammar))
            except GrammarLimitError as e:
                logger.warning("request %s: %s; it ends here (finish_reason length)", req.request_id, e)
                req.clear_drafts()
                req.grammar.end_at_limit(e)
            except Exception as e:  # noqa: BLE001 - this request's grammar, not the batch's
                logger.exception("request %s: its grammar failed", req.request_id)
                req.clear_drafts()
                req.grammar.failed = e
        self.masks.start(jobs)

    def wait_masks(self) -> None:
        """The step's verification masks are all set (after the target's forward)."""
        self.masks.wait()

    def after_append(self, req: Request, appended: list[int], status: RequestStatus | None) -> RequestStatus | None:
        """Advance the matcher by the step's appended tokens -> the request's status. A complete
        constraint allows only the end of sequence, which stops the request, with ignore_eos too
        (``OutputProcessor.append``: accepted drafts after it are dropped)."""
        g = req.grammar
        if g is None:
            return status
        if not g.exhausted:
            try:
                g.advance(appended)
            except GrammarLimitError as e:
                logger.warning("request %s: %s; it ends here (finish_reason length)", req.request_id, e)
                g.exhausted = True
        if g.exhausted:     # the grammar cannot go on within its limits: cut, as at max_tokens
            req.stop_reason = None
            return RequestStatus.FINISHED_LENGTH
        return status


def fit_drafts(req: Request, room: int) -> None:
    """Cut the request's drafts to the grammar, add forced ones (at most ``room`` drafts in all)
    and plan the rows of ``req.grammar.step_bitmask`` [drafts + 1, W] (module docstring)."""
    if req.draft_parents is None:
        _fit_chain(req, room)
    else:
        _fit_tree(req, room)


def _fit_chain(req: Request, room: int) -> None:
    g = req.grammar
    tokens, probs = list(req.draft_token_ids), req.draft_probs
    valid = g.valid_prefix(tokens)
    keep = valid if valid == len(tokens) or probs is None else valid + 1   # q's residual needs its rejected draft
    tokens = tokens[:keep]
    probs = probs[:keep] if probs is not None and keep else None
    if valid == keep and room > keep:
        forced = g.forced_after(tokens)[: room - keep]
        if forced and req.draft_probs is not None:   # forced drafts are certain: one-hot q
            one_hot = torch.zeros(len(forced), req.draft_probs.shape[-1], dtype=req.draft_probs.dtype,
                                  device=req.draft_probs.device)
            one_hot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
            probs = one_hot if probs is None else torch.cat([probs, one_hot])
        tokens += forced
        valid = keep = len(tokens)
    req.draft_token_ids, req.draft_probs = tokens, probs
    g.plan_chain_rows(tokens[:valid], repeat_last=keep - valid)                    # [keep + 1, W] rows


def _fit_tree(req: Request, room: int) -> None:
    g = req.grammar
    tokens, parents = req.draft_token_ids, req.draft_parents
    kept = g.prune_tree(tokens, parents)
    new_index = {old: new for new, old in enumerate(kept)}
    tokens = [tokens[i] for i in kept]
    parents = [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept]
    paths: list[list[int]] = []
    for t, p in zip(tokens, parents):
        paths.append((paths[p] if p >= 0 else []) + [t])
    if room > len(tokens):
        leaf = _first_branch_leaf(parents)
        forced = g.forced_after(paths[leaf] if leaf >= 0 else [])[: room - len(tokens)]
        for t in forced:
            paths.append((paths[leaf] if leaf >= 0 else []) + [t])
            tokens.append(t)
            parents.append(leaf)
            leaf = len(tokens) - 1
    req.draft_token_ids = tokens
    req.draft_parents = parents if tokens else None
    # A draft tree's q rows (sampled children) no longer describe a pruned or extended sample:
    # verify it by the target's choices, exact for any tree of drafts (sample.verify).
    req.draft_probs = None
    if req.draft_parents is None:
        g.plan_chain_rows([])
    else:
        g.plan_tree_rows(paths)                                                    # [n + 1, W] rows


def _first_branch_leaf(parents: list[int]) -> int:
    """The last node down the first branch (first child each time); -1 for an empty tree."""
    node = -1
    while True:
        child = next((i for i, p in enumerate(parents) if p == node), None)
        if child is None:
            return node
        node = child
