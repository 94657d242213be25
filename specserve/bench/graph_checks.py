"""Steps run both ways, through a runner's CUDA graphs and eagerly, for checks that compare them
(benchmarks/gpu_smoke.py on a GPU, tests/worker/test_cuda_graphs.py in the CPU emulation), and
greedy decoding one forward at a time (what a captured greedy chain computes at once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.worker.model_runner import ForwardInput, ForwardOutput, ModelRunner


@dataclass
class BothWays:
    graphed: ForwardOutput
    eager: ForwardOutput
    graphed_cache: list[torch.Tensor]   # each layer's KV cache after the graph step
    eager_cache: list[torch.Tensor]     # ... after the eager step


def graph_and_eager(runner: ModelRunner, inputs: list[ForwardInput], return_all_hidden: bool = False) -> BothWays:
    """The step through ``runner``'s graphs, then eagerly from the same KV cache contents; the cache
    is left as it was before either."""
    graphs = runner.graphs
    assert graphs is not None, "the runner has no graphs (ModelRunner.use_graphs)"
    before = [c.clone() for c in runner.kv_caches]
    graphed = runner.execute(inputs, return_all_hidden)
    graphed_cache = [c.clone() for c in runner.kv_caches]
    for c, b in zip(runner.kv_caches, before):
        c.copy_(b)
    runner.graphs = None
    try:
        eager = runner.execute(inputs, return_all_hidden)
    finally:
        runner.graphs = graphs
    eager_cache = [c.clone() for c in runner.kv_caches]
    for c, b in zip(runner.kv_caches, before):
        c.copy_(b)
    return BothWays(graphed, eager, graphed_cache, eager_cache)


def greedy_steps(runner, first_token: int, position: int, block_table: list[int], steps: int) -> list[int]:
    """``steps`` single-token forwards from ``position``, each fed the previous argmax (the first
    ``first_token``); their argmax tokens."""
    tokens, token = [], first_token
    for j in range(steps):
        token = int(runner.execute([ForwardInput([token], position + j, block_table, 1)]).logits.argmax(-1))
        tokens.append(token)
    return tokens
