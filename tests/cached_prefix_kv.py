"""Shared by the tests that check a proposer's K/V found in prefix-cached blocks
(tests/engine/test_prefix_caching.py for a draft model, tests/spec_decode/test_eagle.py
for an EAGLE head): their prompts, and a read of a request's K/V out of a paged cache."""
from __future__ import annotations

import torch

from specserve.model_executor.layers.attention import cache_slot


def prompts_parting_after_four_blocks(seed: int = 3) -> tuple[list[int], list[int]]:
    """Two prompts of 73 random tokens that share their first 64 (four 16-token blocks) and
    differ at the 65th, the first token of the fifth block."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(100, 40000, (64,), generator=gen).tolist()
    first = shared + torch.randint(100, 40000, (9,), generator=gen).tolist()
    return first, shared + [first[64] + 1] + first[65:]


def kv_at_positions(cache: torch.Tensor, table: list[int], num_positions: int, block_size: int) -> torch.Tensor:
    """A copy of one layer's K/V (``attention.kv_cache_shape``) at a request's positions
    0..num_positions-1 -> [2, Hk, num_positions, hd]."""
    slots = torch.tensor([cache_slot(table, p, block_size) for p in range(num_positions)])
    return cache.view(2, cache.shape[1], -1, cache.shape[4]).index_select(2, slots).clone()
