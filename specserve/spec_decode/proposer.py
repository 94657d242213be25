"""The proposer interface: what guesses draft tokens for verification."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.engine.scheduler import ScheduledRequest


@dataclass
class Proposal:
    """Draft tokens for the requests of one step, aligned with the input list."""

    token_ids: list[list[int]]            # per request, 0..num_lookahead tokens
    probs: list[torch.Tensor | None]      # per request [n_i, V] processed draft probs; None = one-hot


class Proposer(ABC):
    """Guesses up to ``s.num_lookahead`` tokens for each decoding request.

    Proposers that keep a KV cache (draft model, EAGLE) track what they have
    computed in ``request.proposer_num_computed_tokens``; the engine lowers it
    after verification so rejected drafts are recomputed.
    """

    #: True when the proposer needs the target's hidden states (EAGLE).
    needs_target_hidden: bool = False

    @abstractmethod
    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal: ...
