"""The proposer interface: what guesses draft tokens for verification.

Per engine step, for the requests that are decoding:

1. ``propose(scheduled)`` returns up to ``s.num_lookahead`` draft tokens per
   request (and the draft's processed probabilities for sampled requests; ``None``
   means one-hot, i.e. the tokens were chosen deterministically). One-hot
   proposers may return a tree instead of a chain (``Proposal.parents``): every
   branch is verified in the same forward and the longest accepted one kept.
2. The target verifies them in its one forward pass.
3. Only for proposers with ``needs_target_hidden = True`` (EAGLE):
   ``observe(states)`` receives the target's final hidden states at every
   position whose KV the step KEPT: prefill chunks, and for a verification run
   the last token plus the accepted drafts (rejected positions are left out).
   Positions are absolute, so a proposer can tell a continuation from a
   recomputation after preemption. After a tree of drafts the kept positions
   are the accepted branch's: the proposer gets every row of the tree
   (``TargetHidden.tree_rows``) and picks the branch it was told of in
   ``keep_tree_branch`` (``takes_tree_hidden``).

Proposers that keep a KV cache (draft model, EAGLE) track what they have
computed in ``request.proposer_num_computed_tokens``; the engine lowers it to
the target's ``num_computed_tokens`` after verification, so rejected drafts are
recomputed (the scheduler zeroes it on preemption). Per-request state that a
proposer keeps must not outlive the request (see ``EagleProposer``: a
``WeakKeyDictionary`` keyed by the request).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.core.request import Request
from specserve.core.scheduler import ScheduledRequest


@dataclass
class Proposal:
    """Draft tokens for the requests of one step, aligned with the input list."""

    token_ids: list[list[int]]            # per request, 0..num_lookahead tokens
    probs: list[torch.Tensor | None]      # per request [n_i, V] processed draft probs; None = one-hot
    # Trees of drafts (one-hot proposers only): per request, the parent of each draft token
    # (an index into its token_ids, parents first; -1 = the request's last token), or None
    # for a chain (draft i follows draft i - 1). The target verifies every branch at once.
    parents: list[list[int] | None] | None = None


@dataclass
class TargetHidden:
    """The target's final (post-norm) hidden states of one request's kept positions."""

    request: Request
    start_position: int        # position of hidden[0]
    hidden: torch.Tensor       # [n, hidden_size], positions start_position .. start_position + n - 1
    # A verified tree: every row of it ([last token, drafts...] in the step's order), whose
    # accepted branch the kept positions are; ``hidden`` is then empty. None: a chain or prefill.
    tree_rows: torch.Tensor | None = None


class Proposer(ABC):
    """Guesses up to ``s.num_lookahead`` tokens for each decoding request."""

    #: True when the proposer needs the target's hidden states (EAGLE): the engine
    #: then asks the runner for every new token's hidden state and calls ``observe``.
    needs_target_hidden: bool = False
    #: True when drafts cost (next to) nothing to propose and are one-hot (n-gram, suffix):
    #: ``dynamic_k`` then proposes the full K and verifies the part that pays
    #: (``spec_decode.shadow_drafts``). False when each draft position costs a forward.
    drafts_are_free: bool = False
    #: True when a proposer that reads the target's hidden states (EAGLE) can propose trees: it
    #: then gets the hidden states of a tree's accepted branch, in path order.
    takes_tree_hidden: bool = False
    #: True when beam search may fork this proposer's requests: it keeps no per-request K/V
    #: (n-gram, suffix), or keeps it in the target's block tables, copied on a fork through
    #: ``copy_kv_slots``, with any other per-request state handed over in ``fork`` (the draft
    #: model, EAGLE), or treats a forked beam as a new request (a draft with another tokenizer).
    runs_beams: bool = False

    #: How prefix-cached blocks carry this proposer's K/V, where it keeps it in the target's block
    #: tables (``core/kv_cache_manager.py``): "from_tokens" (a draft model: a hit skips its K/V
    #: where an earlier request computed it), "from_features" (EAGLE: computed from the target's
    #: hidden states), None (no K/V there: the cache holds the target's alone).
    cached_kv: str | None = None

    @abstractmethod
    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal: ...

    def catch_up_tokens(self, request: Request) -> int:
        """Tokens this proposer feeds its model before it drafts for ``request``: all it has not
        seen, the prompt too when it has not run for the request yet (``dynamic_k`` prices a
        probe's catch-up with it). This is the convention of proposers that keep a KV cache (above);
        one that keeps it otherwise says so. Free proposers (n-gram, suffix) are never asked."""
        return request.num_tokens - request.proposer_num_computed_tokens

    def observe(self, states: list[TargetHidden]) -> None:  # noqa: B027 - optional hook
        """The target's hidden states after a step (only if ``needs_target_hidden``)."""

    def keep_tree_branch(self, request: Request, path: list[int], last: int) -> None:  # noqa: B027
        """A tree of drafts was verified: ``path`` are the accepted draft indices, root first, and
        ``last`` the position of the request's last token. A proposer with its own KV cache (a draft
        tree's model) moves the branch's K/V to positions last + 1, ... and may raise
        ``request.proposer_num_computed_tokens`` past ``last`` (the engine clamps it to what the
        target keeps). Called before ``Request.commit_step``."""

    def copy_kv_slots(self, src: list[int], dst: list[int]) -> None:  # noqa: B027 - optional hook
        """K/V of the proposer's own cache slot src[i] -> slot dst[i], where that cache follows the
        target's block tables (a draft model's, an EAGLE head's): a forked beam's copy of its
        parent's partial block (``engine/beam_groups.py``), read before any write."""

    def fork(self, parent: Request, child: Request, path: list[int], last: int) -> None:  # noqa: B027
        """A beam search forked ``child`` off ``parent`` this step, before ``observe``: the child's
        tokens are the parent's up to its last token (position ``last``), then the drafts at
        ``path`` (indices into the parent's drafts, one a depth, root first) and one token of its
        own. Its blocks are the parent's below the fork
        and copies above it (``copy_kv_slots``); a proposer that keeps other per-request state
        (EAGLE's target features) gives the child its share of the parent's."""


def kept_hidden_states(
    scheduled: list[ScheduledRequest],
    num_tokens: list[int],        # per request: tokens it fed to the target this step (drafts included)
    starts: list[int],            # per request: num_computed_tokens before the step
    all_hidden: torch.Tensor,     # [sum num_tokens, hidden] the target's hidden state of every new token
    trees: list[bool] | None = None,   # per request: its new tokens were a tree of drafts
) -> list[TargetHidden]:
    """Slice a step's hidden states to the positions each request kept (after verification);
    a tree's rows are passed whole (``TargetHidden.tree_rows``)."""
    out, row = [], 0
    for i, (s, n, start) in enumerate(zip(scheduled, num_tokens, starts)):
        kept = max(0, s.request.num_computed_tokens - start)    # 0: rolled back or preempted after the forward
        if trees is not None and trees[i]:
            out.append(TargetHidden(s.request, start, all_hidden[row:row], all_hidden[row : row + n]))
        else:
            out.append(TargetHidden(s.request, start, all_hidden[row : row + kept]))
        row += n
    return out


def drafts_by_argmax(request: Request) -> bool:
    """True where a request's drafts are the argmax of the draft's own logits: greedy, with no
    penalty or bias adjusting them and no grammar masking them (what a captured greedy chain of
    drafts computes on the device, ``worker/cuda_graphs.py``)."""
    params = request.sampling_params
    return params.greedy and not params.adjusts_logits and getattr(request, "grammar", None) is None
