"""Trees wider than 32 nodes (the kernel's masks are as many 32-bit words as the widest tree needs)
and trees grown over several forwards (earlier nodes cached: ``tree_back``), on both attention paths."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.model_executor.layers import attention, cpu_attention
from specserve.model_executor.layers.attention import AttentionMetadata, kv_cache_shape, paged_attention

from tree_reference import dense_tree_reference
from triton_interpreter import use_triton_interpreter

BLOCK = 4
KERNEL_BUILDS = cpu_attention.usable("cpu", torch.float32)
CPU = torch.device("cpu")


def random_tree(n: int, seed: int) -> list[int]:
    """A root (-1) and n - 1 nodes, each under a random earlier one (deep and wide)."""
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _setup(cached, new, seed, num_blocks=64, kv_heads=2, hd=16):
    torch.manual_seed(seed)
    table = (torch.randperm(num_blocks - 1) + 1)[: -(-(cached + new) // BLOCK)].tolist()
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd))
    keys, values = torch.randn(cached + new, kv_heads, hd), torch.randn(cached + new, kv_heads, hd)
    for p in range(cached):
        kv_cache[0, :, table[p // BLOCK], p % BLOCK] = keys[p]
        kv_cache[1, :, table[p // BLOCK], p % BLOCK] = values[p]
    return table, kv_cache, keys, values


@pytest.fixture(params=["torch", "kernel", "triton"])
def path(request, monkeypatch) -> str:
    """The attention path under test: the compiled CPU kernel, PyTorch's with the kernel off, or
    the GPU path's Triton kernel (in Triton's CPU interpreter)."""
    if request.param == "kernel" and not KERNEL_BUILDS:
        pytest.skip("the CPU attention kernel did not build here")
    if request.param in ("torch", "triton"):
        monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    if request.param == "triton":
        use_triton_interpreter(monkeypatch)
    return request.param


@pytest.mark.parametrize("window", [None, 5])
def test_a_70_node_tree_matches_the_dense_reference(path, window):
    """70 nodes need 3 mask words: every node sees exactly its ancestors (a window of 5 ends inside
    the tree, at each node's own depth)."""
    parents = random_tree(70, seed=1)
    depths, masks = attention.tree_layout(parents)
    assert max(m.bit_length() for m in masks) > 64
    cached, new = 13, len(parents)
    table, kv_cache, keys, values = _setup(cached, new, seed=2)
    heads = 4
    q = torch.randn(new, heads, 16)
    meta = AttentionMetadata.build([new], [cached + new], [table], BLOCK, CPU, tree_masks=[masks])
    assert (meta.kernel is not None) == (path == "kernel") and (meta.triton is not None) == (path == "triton")
    out = paged_attention(q, keys[cached:], values[cached:], kv_cache, meta, scale=0.25, sliding_window=window)
    positions = [cached + d for d in depths]
    expected = dense_tree_reference(q, keys, values, cached, masks, 0.25, window, positions)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_a_tree_grown_over_two_forwards_equals_the_tree_in_one(path, window):
    """A draft grows its tree depth by depth: the second forward's nodes see the first's cached
    nodes only where they are ancestors (``tree_back``), exactly as if the whole tree came at once
    (the kernel: the same bits)."""
    parents = random_tree(40, seed=5)
    _, masks = attention.tree_layout(parents)
    cached, new, first = 11, len(parents), 23
    table, kv_cache, keys, values = _setup(cached, new, seed=6)
    q = torch.randn(new, 4, 16)
    options = dict(scale=0.25, sliding_window=window)
    whole = AttentionMetadata.build([new], [cached + new], [table], BLOCK, CPU, tree_masks=[masks])
    out_whole = paged_attention(q, keys[cached:], values[cached:], kv_cache.clone(), whole, **options)
    grown = kv_cache.clone()
    one = AttentionMetadata.build([first], [cached + first], [table], BLOCK, CPU, tree_masks=[masks[:first]])
    out_one = paged_attention(q[:first], keys[cached:cached + first], values[cached:cached + first], grown, one,
                              **options)
    two = AttentionMetadata.build([new - first], [cached + new], [table], BLOCK, CPU, tree_masks=[masks[first:]],
                                  tree_back=[first])
    out_two = paged_attention(q[first:], keys[cached + first:], values[cached + first:], grown, two, **options)
    if path == "kernel":
        assert torch.equal(torch.cat([out_one, out_two]), out_whole)
    else:
        torch.testing.assert_close(torch.cat([out_one, out_two]), out_whole, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not KERNEL_BUILDS, reason="the CPU attention kernel did not build here")
def test_a_wide_tree_node_equals_its_branch_verified_as_a_chain():
    """Nodes past bit 32 get the bits of their branch verified as a chain (greedy trees of any
    size agree with plain decoding)."""
    parents = random_tree(50, seed=9)
    depths, masks = attention.tree_layout(parents)
    cached, new = 21, len(parents)
    table, kv_cache, keys, values = _setup(cached, new, seed=10)
    q = torch.randn(new, 4, 16)
    meta = AttentionMetadata.build([new], [cached + new], [table], BLOCK, CPU, tree_masks=[masks])
    tree_out = paged_attention(q, keys[cached:], values[cached:], kv_cache.clone(), meta, scale=0.125)
    for node in range(33, new):
        branch = [j for j in range(new) if masks[node] >> j & 1]
        chain = AttentionMetadata.build([len(branch)], [cached + len(branch)], [table], BLOCK, CPU)
        chain_out = paged_attention(q[branch], keys[cached:][branch], values[cached:][branch], kv_cache.clone(),
                                    chain, scale=0.125)
        assert torch.equal(chain_out[-1], tree_out[node]), f"node {node} (depth {depths[node]})"
