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
KERNEL_READS_FP16 = cpu_attention.usable("cpu", torch.float32, torch.float16)


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("group_cost", [0, 10**9, None])  # many groups, one group, the default rule
@pytest.mark.parametrize("hd", [12, 40, 64])  # below the kernel's 16-wide vectors, 2.5 of them, 4
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_paged_attention_matches_dense_reference(monkeypatch, group_cost, path, hd, cache_dtype):
    """Both attention paths against dense attention, for a step mixing decodes, a
    verification and prefill chunks (the kernel serves them all, in tiles of 32 tokens).
    A float16 cache holds K/V rounded to float16; the queries and the output stay float32."""
    if path == "kernel" and not (KERNEL_BUILDS if cache_dtype == torch.float32 else KERNEL_READS_FP16):
        pytest.skip("the CPU attention kernel did not build here (no C compiler, or no F16C for float16)")
    if path == "torch":
        monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    if group_cost is not None:
        monkeypatch.setattr(attention, "GROUP_COST_IN_KEY_POSITIONS", group_cost)
    torch.manual_seed(0)
    heads, kv_heads, num_blocks = 6, 2, 260
    # (tokens already cached, new tokens): decode, verification, prefill chunk, long decode, long prefills
    shapes = [(9, 1), (30, 5), (0, 13), (300, 1), (5, 1), (250, 3), (0, 40), (20, 30), (7, 70)]
    perm = torch.randperm(num_blocks - 1) + 1
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd), dtype=cache_dtype)
    tables, full_k, full_v, next_block = [], [], [], 0
    for cached, new in shapes:
        n = -(-(cached + new) // BLOCK)
        table = perm[next_block:next_block + n].tolist()
        next_block += n
        tables.append(table)
        keys, values = torch.randn(cached + new, kv_heads, hd), torch.randn(cached + new, kv_heads, hd)
        keys, values = keys.to(cache_dtype).float(), values.to(cache_dtype).float()  # what the cache can hold
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
        cache_dtype=cache_dtype,
    )
    assert (meta.kernel is not None) == (path == "kernel")
    if path == "torch" and group_cost == 0:
        assert len(meta.groups) == len(shapes)
    if path == "torch" and group_cost == 10**9:
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
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cached", [37, 38, 39, 40])  # every alignment of the context to 4-key groups
def test_kernel_row_does_not_depend_on_the_other_rows_of_its_step(hd, cache_dtype, cached):
    """Verifying [t, d1..d4] and decoding t alone give the same bits for t's row (and
    each draft's row equals decoding it after the previous ones), so speculative and
    plain decoding see identical attention outputs. (An earlier kernel summed a key's score
    in one of three functions depending on the layout; built with FMA contraction, they
    rounded differently for some alignments.)"""
    torch.manual_seed(0)
    heads, kv_heads, num_blocks, new = 9, 3, 40, 5
    table = torch.randperm(num_blocks)[:12].tolist()
    if cache_dtype == torch.float16 and not KERNEL_READS_FP16:
        pytest.skip("this kernel build does not read float16 caches (no F16C)")
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd), dtype=cache_dtype)
    keys, values = torch.randn(cached + new, kv_heads, hd), torch.randn(cached + new, kv_heads, hd)
    q = torch.randn(new, heads, hd)
    for p in range(cached):
        kv_cache[0, :, table[p // BLOCK], p % BLOCK] = keys[p]
        kv_cache[1, :, table[p // BLOCK], p % BLOCK] = values[p]
    cpu = torch.device("cpu")
    meta = AttentionMetadata.build([new], [cached + new], [table], BLOCK, cpu, cache_dtype=cache_dtype)
    assert meta.kernel is not None
    together = paged_attention(q, keys[cached:], values[cached:], kv_cache.clone(), meta, scale=0.125)
    for i in range(new):
        ctx = cached + i + 1
        one = AttentionMetadata.build([1], [ctx], [table], BLOCK, cpu, cache_dtype=cache_dtype)
        alone = paged_attention(q[i:i + 1], keys[ctx - 1:ctx], values[ctx - 1:ctx], kv_cache, one, scale=0.125)
        assert torch.equal(alone[0], together[i]), f"row {i}"


@pytest.mark.skipif(not KERNEL_BUILDS, reason="the CPU attention kernel did not build here (no C compiler?)")
@pytest.mark.parametrize("hd", [64, 40])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_prompt_rows_do_not_depend_on_where_chunks_are_cut(hd, cache_dtype, threads):
    """A 150-token prompt attended whole, in chunks cut at several places, and one token at a
    time (as a decode step would), alongside other requests of other lengths: every row has
    the same bits each way, on 1 or 2 threads. This is what keeps a greedy answer the same
    whatever the token budget, the prefix cache or speculation did to its prefill."""
    if cache_dtype == torch.float16 and not KERNEL_READS_FP16:
        pytest.skip("this kernel build does not read float16 caches (no F16C)")
    torch.manual_seed(3)
    heads, kv_heads, num_blocks, length = 9, 3, 120, 150
    table = (torch.randperm(num_blocks - 1) + 1)[:-(-length // BLOCK)].tolist()
    keys, values = torch.randn(length, kv_heads, hd), torch.randn(length, kv_heads, hd)
    q = torch.randn(length, heads, hd)
    other_table = [0]  # a short neighbour request in block 0
    other_q, other_kv = torch.randn(3, heads, hd), torch.randn(3, kv_heads, hd)
    cpu = torch.device("cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for cuts in ([length], [64, 86], [1, 31, 33, 85], [100, 49, 1], [1] * length):
            kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd), dtype=cache_dtype)
            rows, start = [], 0
            for n in cuts:
                end = start + n
                meta = AttentionMetadata.build([3, n], [3, end], [other_table, table], BLOCK, cpu,
                                               cache_dtype=cache_dtype)
                assert meta.kernel is not None
                out = paged_attention(torch.cat([other_q, q[start:end]]), torch.cat([other_kv, keys[start:end]]),
                                      torch.cat([other_kv, values[start:end]]), kv_cache, meta, scale=0.125)
                rows.append(out[3:])
                start = end
            results.append(torch.cat(rows))
    finally:
        torch.set_num_threads(before)
    expected = reference_attention(q, keys.to(cache_dtype).float(), values.to(cache_dtype).float(), length, 0.125)
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-5)
    for cuts, result in zip(["64+86", "1+31+33+85", "100+49+1", "one at a time"], results[1:]):
        assert torch.equal(result, results[0]), f"cut {cuts}"


def test_kv_cache_dtype_follows_the_weights_where_attention_reads_it():
    cpu = torch.device("cpu")
    half_on_cpu = attention.kv_cache_dtype_for(torch.float16, torch.float32, cpu)
    assert half_on_cpu == (torch.float16 if KERNEL_READS_FP16 else torch.float32)
    assert attention.kv_cache_dtype_for(torch.float32, torch.float32, cpu) == torch.float32
    assert attention.kv_cache_dtype_for(torch.bfloat16, torch.bfloat16, cpu) == torch.bfloat16
    assert attention.kv_cache_dtype_for(torch.float16, torch.float16, torch.device("meta")) == torch.float16


@pytest.mark.parametrize("num_reqs,length", [(1, 37), (3, 18)])
def test_fresh_prompts_take_the_causal_path_and_match_the_reference(monkeypatch, num_reqs, length):
    """Where the kernel does not serve a step (GPUs, other dtypes), whole prompts with nothing
    cached (one group, equal lengths, the last block part padding) run SDPA in causal mode
    without a mask."""
    monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    torch.manual_seed(1)
    heads, kv_heads, hd, num_blocks = 6, 2, 8, 64
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd))
    per_req = -(-length // BLOCK)
    tables = [list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i in range(num_reqs)]
    meta = AttentionMetadata.build([length] * num_reqs, [length] * num_reqs, tables, BLOCK, torch.device("cpu"))
    assert meta.kernel is None and len(meta.groups) == 1 and meta.groups[0].fresh
    q = torch.randn(num_reqs * length, heads, hd)
    k, v = torch.randn(num_reqs * length, kv_heads, hd), torch.randn(num_reqs * length, kv_heads, hd)
    out = paged_attention(q, k, v, kv_cache, meta, scale=0.3)
    for i in range(num_reqs):
        rows = slice(i * length, (i + 1) * length)
        expected = reference_attention(q[rows], k[rows], v[rows], length, 0.3)
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)


def test_tree_layout_depths_and_ancestor_masks():
    #        root(0)
    #       /      \
    #     1          2
    #    / \          \
    #   3   4          5
    depths, masks = attention.tree_layout([-1, 0, 0, 1, 1, 2])
    assert depths == [0, 1, 1, 2, 2, 2]
    assert masks == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]
    assert attention.tree_layout([-1, 0, 1, 2]) == ([0, 1, 2, 3], [1, 3, 7, 15])  # a chain is causal
    with pytest.raises(ValueError, match="parents must come before"):
        attention.tree_layout([-1, 2, 0])


# A root and 7 drafts in three branches; and a tree whose nodes 5.. see masked keys in
# the middle of their rows (other branches laid out between their ancestors).
TREE = [-1, 0, 1, 0, 3, 1, 5, 2]


def _tree_reference(q, keys, values, cached, masks, scale):
    """Dense attention of one tree request: row i sees the cached keys and its ancestors."""
    new = len(masks)
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, ctx, hd]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    allowed = torch.ones(new, cached + new, dtype=torch.bool)
    for i, m in enumerate(masks):
        allowed[i, cached:] = torch.tensor([bool(m >> j & 1) for j in range(new)])
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=allowed, scale=scale).transpose(0, 1)


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_tree_attention_matches_dense_reference(monkeypatch, path, cache_dtype):
    """A step with a tree of drafts, a chain verification and a prefill: the tree's rows see
    only their ancestors (and the cached context); the others are unaffected."""
    if path == "kernel" and not (KERNEL_BUILDS if cache_dtype == torch.float32 else KERNEL_READS_FP16):
        pytest.skip("the CPU attention kernel did not build here (no C compiler, or no F16C for float16)")
    if path == "torch":
        monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    torch.manual_seed(3)
    heads, kv_heads, hd, num_blocks = 6, 2, 12, 100
    _, tree_masks = attention.tree_layout(TREE)
    shapes = [(21, len(TREE)), (30, 4), (0, 23)]  # (cached, new)
    masks_per_req = [tree_masks, None, None]
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd), dtype=cache_dtype)
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, keys, values = [], [], []
    for cached, new in shapes:
        tables.append([perm.pop() for _ in range(-(-(cached + new) // BLOCK))])
        k = torch.randn(cached + new, kv_heads, hd).to(cache_dtype).float()
        v = torch.randn(cached + new, kv_heads, hd).to(cache_dtype).float()
        keys.append(k)
        values.append(v)
        for p in range(cached):
            kv_cache[0, :, tables[-1][p // BLOCK], p % BLOCK] = k[p]
            kv_cache[1, :, tables[-1][p // BLOCK], p % BLOCK] = v[p]
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK,
                                   torch.device("cpu"), cache_dtype=cache_dtype, tree_masks=masks_per_req)
    assert (meta.kernel is not None) == (path == "kernel")
    q = torch.randn(sum(n for _, n in shapes), heads, hd)
    out = paged_attention(q, torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)]),
                          torch.cat([v[c:] for v, (c, _) in zip(values, shapes)]), kv_cache, meta, scale=0.3)
    row = 0
    for i, ((cached, new), masks) in enumerate(zip(shapes, masks_per_req)):
        if masks is None:
            expected = reference_attention(q[row:row + new], keys[i], values[i], new, 0.3)
        else:
            expected = _tree_reference(q[row:row + new], keys[i], values[i], cached, masks, 0.3)
        torch.testing.assert_close(out[row:row + new], expected, rtol=1e-5, atol=1e-5)
        row += new


@pytest.mark.skipif(not KERNEL_BUILDS, reason="the CPU attention kernel did not build here (no C compiler?)")
@pytest.mark.parametrize("cached", [37, 44])  # the branch's keys land in a vector chunk / in the tail
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_kernel_tree_row_equals_its_branch_verified_as_a_chain(cached, cache_dtype):
    """Every node of a tree gets the same bits as the same branch verified as a chain,
    so greedy verification of any branch agrees with plain decoding token for token."""
    if cache_dtype == torch.float16 and not KERNEL_READS_FP16:
        pytest.skip("this kernel build does not read float16 caches (no F16C)")
    torch.manual_seed(4)
    heads, kv_heads, hd, num_blocks = 9, 3, 64, 64
    new = len(TREE)
    depths, masks = attention.tree_layout(TREE)
    table = torch.randperm(num_blocks)[: -(-(cached + new) // BLOCK)].tolist()
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd), dtype=cache_dtype)
    keys, values = torch.randn(cached + new, kv_heads, hd), torch.randn(cached + new, kv_heads, hd)
    for p in range(cached):
        kv_cache[0, :, table[p // BLOCK], p % BLOCK] = keys[p]
        kv_cache[1, :, table[p // BLOCK], p % BLOCK] = values[p]
    q = torch.randn(new, heads, hd)
    cpu = torch.device("cpu")
    meta = AttentionMetadata.build([new], [cached + new], [table], BLOCK, cpu, cache_dtype=cache_dtype,
                                   tree_masks=[masks])
    tree_out = paged_attention(q, keys[cached:], values[cached:], kv_cache.clone(), meta, scale=0.125)
    for node in range(new):
        branch = [j for j in range(new) if masks[node] >> j & 1]   # root .. node, in order
        chain_meta = AttentionMetadata.build([len(branch)], [cached + len(branch)], [table], BLOCK, cpu,
                                             cache_dtype=cache_dtype)
        chain_out = paged_attention(q[branch], keys[cached:][branch], values[cached:][branch], kv_cache.clone(),
                                    chain_meta, scale=0.125)
        assert torch.equal(chain_out[-1], tree_out[node]), f"node {node} (depth {depths[node]})"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_kernel_writes_the_new_kv_as_torch_would(cache_dtype):
    """When the kernel serves every request of the step it writes their new K/V itself:
    the cache then holds exactly what torch's ``index_copy_`` of ``.to(cache dtype)``
    writes (float16: rounded to nearest even), and the output matches dense attention."""
    if not (KERNEL_BUILDS if cache_dtype == torch.float32 else KERNEL_READS_FP16):
        pytest.skip("the CPU attention kernel did not build here (no C compiler, or no F16C for float16)")
    torch.manual_seed(5)
    heads, kv_heads, hd, num_blocks = 6, 2, 12, 64
    shapes = [(9, 1), (30, 5), (0, 7), (44, 16), (3, 50)]
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd), dtype=cache_dtype)
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, keys, values = [], [], []
    for cached, new in shapes:
        tables.append([perm.pop() for _ in range(-(-(cached + new) // BLOCK))])
        keys.append(torch.randn(cached + new, kv_heads, hd) * 3)
        values.append(torch.randn(cached + new, kv_heads, hd) * 3)
        for p in range(cached):
            kv_cache[0, :, tables[-1][p // BLOCK], p % BLOCK] = keys[-1][p]
            kv_cache[1, :, tables[-1][p // BLOCK], p % BLOCK] = values[-1][p]
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK,
                                   torch.device("cpu"), cache_dtype=cache_dtype)
    assert meta.kernel is not None
    # K and V as strided views of one fused projection output, as the model passes them.
    total = sum(n for _, n in shapes)
    fused = torch.cat([torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)]).reshape(total, -1),
                       torch.cat([v[c:] for v, (c, _) in zip(values, shapes)]).reshape(total, -1)], dim=1)
    k_new, v_new = fused.split(kv_heads * hd, dim=1)
    k_new, v_new = k_new.reshape(total, kv_heads, hd).contiguous(), v_new.reshape(total, kv_heads, hd)  # strides differ
    expected_cache = kv_cache.clone()
    slots = expected_cache.view(2, kv_heads, -1, hd)
    slots[0].index_copy_(1, meta.slot_mapping, k_new.transpose(0, 1).to(cache_dtype))
    slots[1].index_copy_(1, meta.slot_mapping, v_new.transpose(0, 1).to(cache_dtype))
    q = torch.randn(total, heads, hd)
    out = paged_attention(q, k_new, v_new, kv_cache, meta, scale=0.3)
    assert torch.equal(kv_cache, expected_cache)
    row = 0
    for i, (cached, new) in enumerate(shapes):
        ref = reference_attention(q[row:row + new], keys[i].to(cache_dtype).float(), values[i].to(cache_dtype).float(),
                                  new, 0.3)
        torch.testing.assert_close(out[row:row + new], ref, rtol=1e-5, atol=1e-5)
        row += new
