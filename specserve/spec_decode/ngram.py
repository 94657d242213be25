"""N-gram prompt lookup: no model, just the request's own tokens.

The longest suffix of the sequence (between ``min_n`` and ``max_n`` tokens)
that also occurs earlier in prompt + output proposes the tokens that followed
its most recent earlier occurrence: k of them, or with ``adaptive`` (the
default) min(k, n + 1) for a suffix of n tokens, since the chance that a
quoted run goes on grows with how much of it already matched, and every
proposed token costs a verified position. Great for prompts whose answers quote
their input (summaries, code edits, extraction); proposes nothing otherwise,
which costs the engine nothing (a plain decoding step).
"""
from __future__ import annotations

import numpy as np

from specserve.engine.scheduler import ScheduledRequest
from specserve.spec_decode.proposer import Proposal, Proposer


def ngram_lookup(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int, adaptive: bool = False) -> list[int]:
    tokens = np.asarray(tokens, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # All windows of size n that end before the suffix itself starts.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if len(matches):
            start = int(matches[-1]) + n  # token after the most recent earlier occurrence
            length = min(k, n + 1) if adaptive else k
            return tokens[start : start + length].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, adaptive: bool = True):
        self.min_n = min_n
        self.max_n = max_n
        self.adaptive = adaptive

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        drafts = [ngram_lookup(s.request.all_token_ids, self.min_n, self.max_n, s.num_lookahead, self.adaptive) for s in scheduled]
        return Proposal(token_ids=drafts, probs=[None] * len(drafts))
