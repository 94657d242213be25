"""Trees only where they pay: each step's draft shape (a chain of k, or a tree of N nodes) chosen
per batch size from measured tokens per second.

A tree verifies more rows than a chain (N + 1 against k + 1 per request) and its draft runs
``top_k`` rows per expanded depth; it pays only where the extra accepted tokens outweigh that,
which depends on the hardware, the batch size and how well the draft agrees with the target on
the text at hand. Rather than model each part, the policy measures the whole: the proposer
reports, at the start of each proposal, how many tokens its requests emitted since the last one
and how long that took (one engine step when the batch has not changed: same requests, nothing
finished or admitted), and the policy keeps, per batch-size bucket (1, 2-3, 4-7, ...) and per
shape, a running mean of tokens per second. It tries every shape ``MIN_SAMPLES`` times per
bucket, then takes the best, re-trying the least recently used shape every ``PROBE_EVERY``
decisions so that a shape that starts paying (other text, other load) is found again. Every
shape's output is the target's (drafts decide only how many tokens a step emits).

Nothing here touches tensors or the engine (tested with made-up timings).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

MIN_SAMPLES = 3        # measured steps per shape and bucket before the best is exploited
PROBE_EVERY = 24       # then one decision in this many re-tries the least recently used shape
SMOOTHING = 0.25       # weight of a new measurement in a shape's running tokens per second


@dataclass(frozen=True)
class TreeShape:
    """One choice: ``top_k`` children per expanded node, ``max_nodes`` drafts, ``max_depth`` deep
    (a chain of k is top_k 1, k nodes, k deep)."""

    top_k: int
    max_nodes: int
    max_depth: int

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    def __str__(self) -> str:
        return f"chain:{self.max_nodes}" if self.is_chain else f"tree:{self.top_k}/{self.max_nodes}/{self.max_depth}"


def candidate_shapes(top_k: int, max_nodes: int, max_depth: int) -> list[TreeShape]:
    """Chains of 2 .. max_depth drafts, and trees of max_nodes / 2 and max_nodes nodes."""
    chains = [TreeShape(1, k, k) for k in range(2, max(max_depth, 2) + 1)]
    trees = [TreeShape(top_k, n, max_depth) for n in sorted({max_nodes // 2, max_nodes}) if n > max_depth]
    return chains + trees


def batch_bucket(batch_size: int) -> int:
    """1, 2-3, 4-7, 8-15, ... -> 0, 1, 2, 3, ..."""
    return max(batch_size, 1).bit_length() - 1


class TreeSizePolicy:
    def __init__(self, shapes: list[TreeShape], clock=time.perf_counter):
        if not shapes:
            raise ValueError("a tree-size policy needs at least one shape")
        self.shapes = shapes
        self.clock = clock
        self.rate: dict[tuple[int, TreeShape], float] = {}     # (bucket, shape) -> tokens per second
        self.samples: dict[tuple[int, TreeShape], int] = {}
        self.last_used: dict[tuple[int, TreeShape], int] = {}
        self.decisions = 0
        self._pending: tuple[int, TreeShape, tuple[str, ...], int, float] | None = None

    def choose(self, request_ids: list[str], emitted: list[int]) -> TreeShape:
        """This step's shape for these decoding requests (``emitted``: each one's output tokens so
        far); also credits the previous choice if the batch is the same one."""
        now = self.clock()
        ids = tuple(request_ids)
        total = sum(emitted)
        if self._pending is not None:
            bucket, shape, last_ids, last_total, started = self._pending
            if last_ids == ids and now > started and total > last_total:
                self._record(bucket, shape, (total - last_total) / (now - started))
        bucket = batch_bucket(len(ids))
        shape = self._pick(bucket)
        self.decisions += 1
        self.last_used[bucket, shape] = self.decisions
        self._pending = (bucket, shape, ids, total, now)
        return shape

    def best(self, batch_size: int) -> TreeShape | None:
        """The measured best shape for a batch size (None before any measurement)."""
        bucket = batch_bucket(batch_size)
        known = [s for s in self.shapes if (bucket, s) in self.rate]
        return max(known, key=lambda s: self.rate[bucket, s]) if known else None

    def _record(self, bucket: int, shape: TreeShape, tokens_per_second: float) -> None:
        key = (bucket, shape)
        n = self.samples.get(key, 0)
        old = self.rate.get(key)
        self.rate[key] = tokens_per_second if old is None else (
            old + (tokens_per_second - old) / (n + 1) if n < MIN_SAMPLES else
            old + SMOOTHING * (tokens_per_second - old))
        self.samples[key] = n + 1

    def _pick(self, bucket: int) -> TreeShape:
        untried = [s for s in self.shapes if self.samples.get((bucket, s), 0) < MIN_SAMPLES]
        if untried:
            return min(untried, key=lambda s: self.last_used.get((bucket, s), 0))
        if self.decisions % PROBE_EVERY == PROBE_EVERY - 1:
            return min(self.shapes, key=lambda s: self.last_used.get((bucket, s), 0))
        return max(self.shapes, key=lambda s: self.rate[bucket, s])
