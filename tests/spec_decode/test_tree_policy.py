"""The tree-size policy on made-up drafts and timings: it measures each shape per batch size and
keeps the fastest, a tree only where a tree is faster than every chain, and with noisy token
counts it still runs at nearly the best fixed shape's rate; and replayed on step times measured
on the real pair, noise and all, it runs near the best fixed shape's rate too."""
from __future__ import annotations

import gzip
import json
import os
import random

from specserve.spec_decode.tree_policy import (PROBE_EVERY, TreeShape, TreeSizePolicy, batch_bucket,
                                               candidate_shapes)


class FakeEngine:
    """Steps of a fixed batch. Each request accepts its drafts one position at a time, with the
    chance ``accept(shape, position)``, and emits the accepted ones plus one token; a step takes
    ``seconds(shape, batch)``."""

    def __init__(self, policy: TreeSizePolicy, accept, seconds, seed: int = 0):
        self.now, self.tokens, self.elapsed = 0.0, 0, 0.0
        self.policy, self.accept, self.seconds = policy, accept, seconds
        policy.clock = lambda: self.now
        self.rng = random.Random(seed)

    def emitted(self, shape: TreeShape) -> int:
        depth = shape.max_nodes if shape.is_chain else shape.max_depth
        n = 0
        while n < depth and self.rng.random() < self.accept(shape, n):
            n += 1
        return n + 1

    def run(self, batch: int, steps: int, prefix: str = "r") -> list[TreeShape]:
        ids = [f"{prefix}{i}" for i in range(batch)]
        emitted, chosen = [0] * batch, []
        for _ in range(steps):
            shape = self.policy.choose(ids, emitted)
            chosen.append(shape)
            new = [self.emitted(shape) for _ in ids]
            emitted = [e + n for e, n in zip(emitted, new)]
            seconds = self.seconds(shape, batch)
            self.now += seconds
            self.tokens += sum(new) / batch
            self.elapsed += seconds
        return chosen


def expected_rate(shape: TreeShape, batch: int, accept, seconds) -> float:
    """Tokens a request emits per second with ``shape``, exactly."""
    depth = shape.max_nodes if shape.is_chain else shape.max_depth
    tokens, reach = 1.0, 1.0
    for i in range(depth):
        reach *= accept(shape, i)
        tokens += reach
    return tokens / seconds(shape, batch)


def rows_accept(shape: TreeShape, position: int) -> float:
    """A chain's drafts are accepted 60% of the time; a tree's branches catch 85%."""
    return 0.6 if shape.is_chain else 0.85


def rows_seconds(shape: TreeShape, batch: int) -> float:
    """Verified rows are nearly free at batch 1 and cost at batch 8."""
    return 0.05 + (0.0005 if batch == 1 else 0.004) * batch * (shape.max_nodes + 1)


def test_candidates_are_chains_and_two_tree_sizes():
    shapes = candidate_shapes(4, 16, 5)
    assert [str(s) for s in shapes] == ["chain:2", "chain:3", "chain:4", "chain:5", "tree:4/8/5", "tree:4/16/5"]
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [0, 1, 1, 2, 2, 3, 6]


def test_a_tree_where_it_pays_and_a_chain_where_it_does_not():
    shapes = candidate_shapes(4, 16, 4)
    policy = TreeSizePolicy(shapes)
    engine = FakeEngine(policy, rows_accept, rows_seconds)
    tail = engine.run(1, 200)[100:]
    assert not policy.best(1).is_chain
    assert sum(not s.is_chain for s in tail) >= len(tail) * (1 - 2 / PROBE_EVERY)
    tail = engine.run(8, 200, prefix="b")[100:]
    best_b8 = max(shapes, key=lambda s: expected_rate(s, 8, rows_accept, rows_seconds))
    assert best_b8.is_chain and policy.best(8) == best_b8
    assert sum(s == best_b8 for s in tail) >= len(tail) * (1 - 2 / PROBE_EVERY)
    assert not policy.best(1).is_chain          # buckets are measured apart


def test_chains_pool_their_acceptance():
    """Every chain's steps measure the acceptance at the positions it drafted: the policy settles
    on chains of 2 here, and those steps are what chains of 3 and 4 are estimated from at the
    first two positions (the rest comes from their own tries and probes)."""
    shapes = [TreeShape(1, k, k) for k in (2, 3, 4)]
    policy = TreeSizePolicy(shapes)
    FakeEngine(policy, lambda shape, i: [0.9, 0.7, 0.5, 0.3][i], rows_seconds).run(4, 300)
    bucket = batch_bucket(4)
    assert policy.best(4) == shapes[0]
    drafted, accepted = policy.drafted[bucket], policy.accepted[bucket]
    assert len(drafted) == 4 and drafted[3] > 0
    assert [round(a / d, 1) for a, d in zip(accepted[:2], drafted[:2])] == [0.9, 0.7]
    a1, a2 = accepted[0] / drafted[0], accepted[1] / drafted[1]
    assert abs(policy._tokens_per_step(bucket, shapes[1]) - (1 + a1 + a1 * a2 + a1 * a2 * accepted[2] / drafted[2])) < 1e-9


def test_a_changed_batch_is_not_credited():
    """A step in which requests joined or left (a prefill, a finish) times something else."""
    shape = TreeShape(1, 2, 2)
    policy = TreeSizePolicy([shape], clock=iter([0.0, 1.0, 2.0, 3.0]).__next__)
    policy.choose(["a"], [0])
    policy.choose(["a", "b"], [3, 0])        # another batch: the first step is not credited
    assert policy.samples == {}
    policy.choose(["a", "b"], [6, 3])        # the same batch: 3 tokens each (both drafts accepted) in 1 s
    assert policy.seconds[1, shape] == 1.0 and policy.rate(1, shape) == 3.0


def test_noisy_steps_still_run_near_the_best_fixed_shape():
    """The Qwen pair's shape of costs on a CPU (a draft forward 28-31 ms, a verification 57-120 ms;
    chains accept 0.8, 0.92, 0.85, ... at each position, the tree 2/8 a little more): a step's
    token count is noisy (1 to k + 1), and the shapes are within 15% of each other. Over 400
    steps the policy runs at 97% or more of the best fixed shape's rate on average (a running
    mean of each shape's tokens per second, the policy before, reached 95%)."""
    alpha = [0.8, 0.92, 0.85, 0.87, 0.85]
    verify_ms = {3: 69, 4: 75, 5: 82, 6: 95, 9: 120}

    def accept(shape, i):
        return alpha[i] if shape.is_chain else min(0.97, alpha[i] + 0.07)

    def seconds(shape, batch):
        return (shape.max_nodes * 28 + verify_ms[shape.max_nodes + 1] if shape.is_chain else 5 * 31 + 120) / 1000

    shapes = candidate_shapes(2, 8, 5)
    best = max(expected_rate(s, 1, accept, seconds) for s in shapes)
    ratios = []
    for seed in range(40):
        engine = FakeEngine(TreeSizePolicy(shapes), accept, seconds, seed=seed)
        engine.run(1, 400)
        ratios.append(engine.tokens / engine.elapsed / best)
    assert sum(ratios) / len(ratios) >= 0.97


def test_a_request_with_fewer_drafts_than_the_chain_is_not_counted_as_rejecting():
    """Near max_tokens a request drafts fewer than the chain's k: all of them accepted is no
    rejection at the next position, which it never drafted."""
    shape = TreeShape(1, 4, 4)
    policy = TreeSizePolicy([shape], clock=iter([0.0, 1.0]).__next__)
    policy.choose(["a", "b"], [0, 0], budgets=[4, 2])
    policy.choose(["a", "b"], [3, 3], budgets=[4, 1])   # a: 2 of 4 accepted; b: 2 of its 2
    assert policy.drafted[1] == [2.0, 2.0, 1.0, 0.0] and policy.accepted[1] == [2.0, 2.0, 0.0, 0.0]


# Steps the policy measured on the real pair (Qwen2.5-Coder 1.5B drafted by the 0.5B on a 2-core
# Xeon with AMX; benchmarks/record_tree_policy.py, the command is in the file).
MEASURED = os.path.join(os.path.dirname(__file__), "data", "tree_policy_steps.json.gz")


def test_on_measured_step_times_the_policy_runs_near_the_best_fixed_shape():
    """A replay on real step times: each step of a shape takes one of the times the policy measured
    for that shape in a recorded run (the VM's noise included), over 8 prompts whose drafts are
    accepted at each position as often as the chain of 3's were on them in that run (0.5-0.9; a
    tree's nodes alike: its recorded steps emitted no more than the chain of 5's). Averaged
    over 20 replays the policy runs at 97% or more of the best fixed shape's rate (0.99 on this
    recording: three steps of each shape, a probe every PROBE_EVERY steps, and moves between
    chains of 3 and 4, which measure within a few percent of each other). Probing every 4 steps,
    or 30 steps of each shape before choosing, fails it."""
    with gzip.open(MEASURED) as f:
        recorded = json.load(f)
    times: dict[str, list[float]] = {}
    for step in recorded["steps"]:
        times.setdefault(step["shape"], []).append(step["seconds"])
    acceptance = [r["acceptance_rate"] for r in recorded["acceptance"]
                  if r["config"] == "draft:3" and r["category"] != "all"]   # per prompt, not the total
    shapes = candidate_shapes(2, 8, 5)
    assert sorted(times) == sorted(str(s) for s in shapes) and len(acceptance) == 8
    steps_per_prompt = 60

    def fixed_rate(shape: TreeShape) -> float:
        """Over the prompts (the same steps each): the mean of each prompt's exact rate."""
        def mean_seconds(s: TreeShape, batch: int) -> float:
            return sum(times[str(s)]) / len(times[str(s)])

        return sum(expected_rate(shape, 1, lambda s, i, a=a: a, mean_seconds) for a in acceptance) / len(acceptance)

    best = max(fixed_rate(s) for s in shapes)
    ratios = []
    for seed in range(20):
        rng = random.Random(1000 + seed)
        engine = FakeEngine(TreeSizePolicy(shapes), None, lambda shape, batch: rng.choice(times[str(shape)]), seed)
        for p, a in enumerate(acceptance):
            engine.accept = lambda shape, i, a=a: a
            engine.run(1, steps_per_prompt, prefix=f"prompt{p}-")
        ratios.append(engine.tokens / engine.elapsed / best)
    assert sum(ratios) / len(ratios) >= 0.97, sorted(ratios)
