"""Paged attention against a dense per-request reference, one and several context groups."""
import random

import pytest
import torch
import torch.nn.functional as F

from specserve.model_executor.layers import attention, cpu_attention
from specserve.model_executor.layers.attention import (
    AttentionMetadata,
    kv_cache_shape,
    paged_attention,
    split_by_context_length,
)

BLOCK = 4


def test_similar_lengths_stay_one_group_in_order():
    assert split_by_context_length([40, 37, 44, 41], BLOCK) == [[0, 1, 2, 3]]


def test_mixed_lengths_split_into_short_and_long():
    lens = [30, 900, 25, 40, 880, 33]
    groups = split_by_context_length(lens, BLOCK, group_cost=64)
    assert sorted(map(sorted, groups)) == [[0, 2, 3, 5], [1, 4]]


def test_every_request_in_exactly_one_group():
    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(1, 500) for _ in range(rng.randint(1, 20))]
        groups = split_by_context_length(lens, BLOCK, group_cost=rng.choice([0, 16, 256]))
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))


def reference_attention(q, keys, values, q_len, scale):
    """Dense causal attention of one request: q [q_len, Hq, hd], keys/values [ctx, Hk, hd]."""
    ctx = keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, ctx, hd]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(ctx - q_len, ctx)
    mask = torch.arange(ctx)[None, :] <= q_pos[:, None]          # [q_len, ctx]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


KERNEL_BUILDS = cpu_attention.usable("cpu", torch.float32)


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("group_cost", [0, 10**9, None])  # many groups, one group, the default rule
@pytest.mark.parametrize("hd", [8, 12])  # the kernel's 8-wide vectors, and a remainder
def test_paged_attention_matches_dense_reference(monkeypatch, group_cost, path, hd):
    """Both attention paths against dense attention. With the kernel, requests of at
    most MAX_QUERY_LEN new tokens take it and the longer prefills take SDPA in the same step."""
    if path == "kernel" and not KERNEL_BUILDS:
        pytest.skip("the CPU attention kernel did not build here (no C compiler?)")
    if path == "torch":
        monkeypatch.setattr(cpu_attention, "usable", lambda device, dtype: False)
    if group_cost is not None:
        monkeypatch.setattr(attention, "GROUP_COST_IN_KEY_POSITIONS", group_cost)
    torch.manual_seed(0)
    heads, kv_heads, num_blocks = 6, 2, 200
    # (tokens already cached, new tokens): decode, verification, prefill chunk, long decode, long prefills
    shapes = [(9, 1), (30, 5), (0, 13), (300, 1), (5, 1), (250, 3), (0, 40), (20, 30)]
    perm = torch.randperm(num_blocks - 1) + 1
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd))
    tables, full_k, full_v, next_block = [], [], [], 0
    for cached, new in shapes:
        n = -(-(cached + new) // BLOCK)
        table = perm[next_block:next_block + n].tolist()
        next_block += n
        tables.append(table)
        keys, values = torch.randn(cached + new, kv_heads, hd), torch.randn(cached + new, kv_heads, hd)
        full_k.append(keys)
        full_v.append(values)
        for p in range(cached):  # what earlier steps wrote
            kv_cache[0, :, table[p // BLOCK], p % BLOCK] = keys[p]
            kv_cache[1, :, table[p // BLOCK], p % BLOCK] = values[p]
    meta = AttentionMetadata.build(
        query_lens=[new for _, new in shapes],
        context_lens=[c + n for c, n in shapes],
        block_tables=tables,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    on_sdpa = [i for i, (_, new) in enumerate(shapes) if path == "torch" or new > cpu_attention.MAX_QUERY_LEN]
    assert (meta.kernel is not None) == (path == "kernel")
    if group_cost == 0:
        assert len(meta.groups) == len(on_sdpa)
    if group_cost == 10**9:
        assert len(meta.groups) == 1
    q = torch.randn(sum(n for _, n in shapes), heads, hd)
    k_new = torch.cat([full_k[i][c:] for i, (c, _) in enumerate(shapes)])
    v_new = torch.cat([full_v[i][c:] for i, (c, _) in enumerate(shapes)])
    out = paged_attention(q, k_new, v_new, kv_cache, meta, scale=0.3)
    row = 0
    for i, (cached, new) in enumerate(shapes):
        expected = reference_attention(q[row:row + new], full_k[i], full_v[i], new, 0.3)
        torch.testing.assert_close(out[row:row + new], expected, rtol=1e-5, atol=1e-5)
        row += new


@pytest.mark.skipif(not KERNEL_BUILDS, reason="the CPU attention kernel did not build here (no C compiler?)")
@pytest.mark.parametrize("hd", [64, 12])
def test_kernel_row_does_not_depend_on_the_other_rows_of_its_step(hd):
    """Verifying [t, d1..d4] and decoding t alone give the same bits for t's row (and
    each draft's row equals decoding it after the previous ones), so speculative and
    plain decoding see identical attention outputs."""
    torch.manual_seed(0)
    heads, kv_heads, num_blocks, cached, new = 9, 3, 40, 37, 5
    table = torch.randperm(num_blocks)[:12].tolist()
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd))
    keys, values = torch.randn(cached + new, kv_heads, hd), torch.randn(cached + new, kv_heads, hd)
    q = torch.randn(new, heads, hd)
    for p in range(cached):
        kv_cache[0, :, table[p // BLOCK], p % BLOCK] = keys[p]
        kv_cache[1, :, table[p // BLOCK], p % BLOCK] = values[p]
    cpu = torch.device("cpu")
    meta = AttentionMetadata.build([new], [cached + new], [table], BLOCK, cpu)
    together = paged_attention(q, keys[cached:], values[cached:], kv_cache.clone(), meta, scale=0.125)
    for i in range(new):
        ctx = cached + i + 1
        one = AttentionMetadata.build([1], [ctx], [table], BLOCK, cpu)
        alone = paged_attention(q[i:i + 1], keys[ctx - 1:ctx], values[ctx - 1:ctx], kv_cache, one, scale=0.125)
        assert torch.equal(alone[0], together[i]), f"row {i}"
