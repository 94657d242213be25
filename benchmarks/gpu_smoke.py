"""The GPU path in seconds, before anything slower: the Triton attention kernel compiles, CUDA graphs
capture and replay, and their steps agree with eager ones. benchmarks/gpu_check.sh runs it first
and stops when it fails, so a broken path costs seconds of a GPU lease, not minutes.

    python benchmarks/gpu_smoke.py            # on a CUDA machine; prints PASS or FAIL lines, exits 1 on a FAIL
    python benchmarks/gpu_smoke.py --device cpu   # the same logic on a CPU (needs SPECSERVE_GRAPHS_ON_CPU=1,
                                                  # SPECSERVE_TRITON_ON_CPU=1, TRITON_INTERPRET=1)

A random-weight SmolLM2-135M shape in float32 (so graphs and eager agree to float32 rounding):
two requests prefilled eagerly, then a decode step, a verification of 5 and 2 rows and greedy
chains of 3 and 2 steps, each through the graphs and eagerly over the same cache.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specserve.bench.graph_checks import graph_and_eager, greedy_steps
from specserve.bench.random_weights import random_runner
from specserve.worker.model_runner import ForwardInput


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="smollm2-135m")
    args = p.parse_args()
    start = time.perf_counter()
    runner = random_runner(args.shape, torch.float32, args.device, max_model_len=512, kv_cache_memory=1 << 26,
                           max_num_reqs=4, max_query_len=6, max_chain_steps=3)
    if runner.graphs is None:
        print("FAIL no graphs: CUDA and Triton are needed (or the CPU emulation's variables)")
        return 1
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 23)]
    tables = [[0, 1, 2, 3], [4, 5, 6]]
    graphs, runner.graphs = runner.graphs, None
    for ids, table in zip(prompts, tables):
        runner.execute([ForwardInput(ids, 0, table, 1)])
    runner.graphs = graphs
    steps = {
        "decode": [ForwardInput([5], 40, tables[0], 1), ForwardInput([6], 23, tables[1], 1)],
        "verify": [ForwardInput([5, 7, 9, 11, 13], 40, tables[0], 5), ForwardInput([6, 8], 23, tables[1], 2)],
    }
    failed = 0
    for name, inputs in steps.items():
        both = graph_and_eager(runner, inputs)
        graphed = both.graphed.logits
        diff = (graphed - both.eager.logits).abs().max().item()
        ok = diff < 1e-3 and bool(torch.isfinite(graphed).all())
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: max |graph - eager| = {diff:.2e}")
    chain = graphs.greedy_chain(graphs.chain_bucket(2, 3), [5, 6], [40, 23], tables, [3, 2])
    runner.graphs = None
    stepped = [greedy_steps(runner, *step) for step in zip([5, 6], [40, 23], tables, [3, 2])]
    runner.graphs = graphs
    ok = chain == stepped
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'} greedy chain: {chain} against step by step {stepped}")
    print(f"{len(graphs.captured)} step graphs and {len(graphs.chains)} chain graphs in "
          f"{time.perf_counter() - start:.1f} s; capture: {graphs.capture}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
