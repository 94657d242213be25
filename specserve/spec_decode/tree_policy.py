"""Trees only where they pay: each step's draft shape (a chain of k, or a tree of N nodes) chosen
per batch size from measured step times and acceptance.

A tree verifies more rows than a chain (N + 1 against k + 1 per request) and its draft runs
``top_k`` rows per expanded depth; it pays only where the extra accepted tokens outweigh that,
which depends on the hardware, the batch size and how well the draft agrees with the target on
the text at hand. The proposer reports, at the start of each proposal, how many tokens each
request emitted since the last one and how long that took (one engine step when the batch has
not changed: same requests, nothing finished or admitted). Per batch-size bucket (1, 2-3, 4-7,
...) the policy keeps:

- per shape, the running mean of a step's seconds (nearly the same every step);
- for chains, pooled over every chain length, how often a draft at position i was accepted once
  the one before it was (a request that emitted n tokens after drafting k accepted n - 1 and, if
  n - 1 < k, rejected the next): a chain of k then emits 1 + a_1 + a_1 a_2 + ... tokens a step;
- for trees, the running mean of the tokens a request emits a step.

A shape's rate is its tokens per request and step over its seconds. Measured per step, tokens are
noisy (1 to k + 1), so a running mean of tokens per second jumps between close shapes; pooling the
chains' acceptance and timing each shape apart gave the best fixed shape's rate within 1-2% where
the per-step mean lost 5% (tests/spec_decode/test_tree_policy.py simulates both). It tries every
shape ``MIN_SAMPLES`` times per bucket, then takes the best, re-trying the least recently used
shape every ``PROBE_EVERY`` decisions so that a shape that starts paying (other text, other load)
is found again. Every shape's output is the target's (drafts decide only how many tokens a step
emits).

Nothing here touches tensors or the engine (tested with made-up timings).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

MIN_SAMPLES = 3        # measured steps per shape and bucket before the best is exploited
PROBE_EVERY = 24       # then one decision in this many re-tries the least recently used shape
SMOOTHING = 0.25       # weight of a new step in a shape's running step seconds
TREE_SMOOTHING = 0.1   # ... in a tree's running tokens a step (noisier than seconds)
ACCEPT_DECAY = 0.98    # per credited chain step: older acceptance counts fade (other text)


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
        self.seconds: dict[tuple[int, TreeShape], float] = {}   # (bucket, shape) -> a step's seconds
        self.tree_tokens: dict[tuple[int, TreeShape], float] = {}   # trees: tokens a request emits a step
        self.drafted: dict[int, list[float]] = {}    # bucket -> per position: drafts that reached it
        self.accepted: dict[int, list[float]] = {}   # bucket -> per position: of those, accepted
        self.samples: dict[tuple[int, TreeShape], int] = {}
        self.last_used: dict[tuple[int, TreeShape], int] = {}
        self.decisions = 0
        self._pending: tuple[int, TreeShape, tuple[str, ...], list[int], list[int] | None, float] | None = None

    def choose(self, request_ids: list[str], emitted: list[int], budgets: list[int] | None = None) -> TreeShape:
        """This step's shape for these decoding requests (``emitted``: each one's output tokens so
        far; ``budgets``: the drafts each may take this step, fewer than a shape's near
        ``max_tokens``); also credits the previous choice if the batch is the same one."""
        now = self.clock()
        ids = tuple(request_ids)
        if self._pending is not None:
            bucket, shape, last_ids, last_emitted, last_budgets, started = self._pending
            deltas = [e - last for e, last in zip(emitted, last_emitted)]
            if last_ids == ids and now > started and all(d > 0 for d in deltas):
                self._record(bucket, shape, deltas, last_budgets, now - started)
        bucket = batch_bucket(len(ids))
        shape = self._pick(bucket)
        self.decisions += 1
        self.last_used[bucket, shape] = self.decisions
        self._pending = (bucket, shape, ids, list(emitted), None if budgets is None else list(budgets), now)
        return shape

    def rate(self, bucket: int, shape: TreeShape) -> float:
        """Tokens a request emits per second with ``shape`` (needs a measured step of it)."""
        return self._tokens_per_step(bucket, shape) / self.seconds[bucket, shape]

    def best(self, batch_size: int) -> TreeShape | None:
        """The measured best shape for a batch size (None before any measurement)."""
        bucket = batch_bucket(batch_size)
        known = [s for s in self.shapes if (bucket, s) in self.seconds]
        return max(known, key=lambda s: self.rate(bucket, s)) if known else None

    def _tokens_per_step(self, bucket: int, shape: TreeShape) -> float:
        if not shape.is_chain:
            return self.tree_tokens[bucket, shape]
        drafted, accepted = self.drafted.get(bucket, []), self.accepted.get(bucket, [])
        tokens, reach = 1.0, 1.0
        for i in range(shape.max_nodes):
            # an unmeasured position counts as accepted: optimistic, so it gets tried
            reach *= accepted[i] / drafted[i] if i < len(drafted) and drafted[i] > 0 else 1.0
            tokens += reach
        return tokens

    def _record(self, bucket: int, shape: TreeShape, deltas: list[int], budgets: list[int] | None,
                seconds: float) -> None:
        key = (bucket, shape)
        n = self.samples.get(key, 0)
        self.seconds[key] = _running_mean(self.seconds.get(key), seconds, n, SMOOTHING)
        per_request = sum(deltas) / len(deltas)
        if not shape.is_chain:
            self.tree_tokens[key] = _running_mean(self.tree_tokens.get(key), per_request, n, TREE_SMOOTHING)
        else:
            k = shape.max_nodes
            drafted = self.drafted.setdefault(bucket, [])
            accepted = self.accepted.setdefault(bucket, [])
            drafted += [0.0] * (k - len(drafted))
            accepted += [0.0] * (k - len(accepted))
            for i in range(len(drafted)):
                drafted[i] *= ACCEPT_DECAY
                accepted[i] *= ACCEPT_DECAY
            for r, d in enumerate(deltas):
                drafts = k if budgets is None else min(k, budgets[r])
                took = min(int(d) - 1, drafts)        # drafts accepted; the next one, if any, rejected
                for i in range(min(took + 1, drafts)):
                    drafted[i] += 1.0
                for i in range(took):
                    accepted[i] += 1.0
        self.samples[key] = n + 1

    def _pick(self, bucket: int) -> TreeShape:
        untried = [s for s in self.shapes if self.samples.get((bucket, s), 0) < MIN_SAMPLES]
        if untried:
            return min(untried, key=lambda s: self.last_used.get((bucket, s), 0))
        if self.decisions % PROBE_EVERY == PROBE_EVERY - 1:
            return min(self.shapes, key=lambda s: self.last_used.get((bucket, s), 0))
        return max(self.shapes, key=lambda s: self.rate(bucket, s))


def _running_mean(old: float | None, value: float, n: int, weight: float) -> float:
    """The mean of the first MIN_SAMPLES values, then an exponential average with ``weight``."""
    if old is None:
        return value
    return old + (value - old) / (n + 1) if n < MIN_SAMPLES else old + weight * (value - old)
