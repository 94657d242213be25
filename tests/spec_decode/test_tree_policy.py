"""The tree-size policy on made-up timings: it measures each shape per batch size and keeps the
fastest, a tree only where a tree is faster than every chain."""
from __future__ import annotations

from specserve.spec_decode.tree_policy import (MIN_SAMPLES, PROBE_EVERY, TreeShape, TreeSizePolicy, batch_bucket,
                                               candidate_shapes)


class FakeEngine:
    """Steps of a fixed batch: each shape's (tokens per request, seconds) at each batch size."""

    def __init__(self, policy: TreeSizePolicy, speed):
        self.now = 0.0
        self.policy = policy
        policy.clock = lambda: self.now
        self.speed = speed            # (shape, batch) -> (tokens per request per step, step seconds)

    def run(self, batch: int, steps: int, prefix: str = "r") -> list[TreeShape]:
        ids = [f"{prefix}{i}" for i in range(batch)]
        emitted, chosen = [0] * batch, []
        for _ in range(steps):
            shape = self.policy.choose(ids, emitted)
            chosen.append(shape)
            tokens, seconds = self.speed(shape, batch)
            self.now += seconds
            emitted = [e + tokens for e in emitted]
        return chosen


def speed(shape: TreeShape, batch: int) -> tuple[float, float]:
    """Trees accept more (3.0 against 2.2 tokens a step) but verify more rows: at batch 1 rows are
    nearly free, at batch 8 each one costs."""
    tokens = 3.0 if not shape.is_chain else 1.0 + 0.3 * shape.max_nodes
    rows = batch * (shape.max_nodes + 1)
    return tokens, 0.05 + (0.0005 if batch == 1 else 0.004) * rows


def test_candidates_are_chains_and_two_tree_sizes():
    shapes = candidate_shapes(4, 16, 5)
    assert [str(s) for s in shapes] == ["chain:2", "chain:3", "chain:4", "chain:5", "tree:4/8/5", "tree:4/16/5"]
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [0, 1, 1, 2, 2, 3, 6]


def test_a_tree_where_it_pays_and_a_chain_where_it_does_not():
    shapes = candidate_shapes(4, 16, 4)
    policy = TreeSizePolicy(shapes)
    engine = FakeEngine(policy, speed)
    chosen = engine.run(1, 120)
    explored = len(shapes) * (MIN_SAMPLES + 1)
    tail = chosen[explored:]
    best_b1 = max(shapes, key=lambda s: speed(s, 1)[0] / speed(s, 1)[1])
    assert not best_b1.is_chain and policy.best(1) == best_b1
    assert sum(s == best_b1 for s in tail) >= len(tail) * (1 - 2 / PROBE_EVERY)
    engine.run(8, 120, prefix="b")
    best_b8 = max(shapes, key=lambda s: speed(s, 8)[0] / speed(s, 8)[1])
    assert best_b8.is_chain and policy.best(8) == best_b8
    assert policy.best(1) == best_b1          # buckets are measured apart


def test_a_changed_batch_is_not_credited():
    """A step in which requests joined or left (a prefill, a finish) times something else."""
    policy = TreeSizePolicy([TreeShape(1, 2, 2)], clock=iter([0.0, 1.0, 2.0, 3.0]).__next__)
    policy.choose(["a"], [0])
    policy.choose(["a", "b"], [3, 0])        # another batch: the first step is not credited
    assert policy.samples == {}
    policy.choose(["a", "b"], [6, 3])        # the same batch: 6 tokens in 1 second
    assert policy.rate[1, TreeShape(1, 2, 2)] == 6.0
