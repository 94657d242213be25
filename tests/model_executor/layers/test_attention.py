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

from tree_reference import dense_tree_reference
from triton_interpreter import use_triton_interpreter

BLOCK = 4
# Each attention path with the caches it reads: the Triton kernel (GPUs) reads a cache in the
# queries' dtype, float32 here.
PATHS_AND_CACHES = [("torch", torch.float32), ("torch", torch.float16), ("kernel", torch.float32),
                    ("kernel", torch.float16), ("triton", torch.float32)]


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
    assert (meta.kernel is not None) == (path == "kernel") and (meta.triton is not None) == (path == "triton")
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
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (7, 3.0)])
def test_kernel_row_does_not_depend_on_the_other_rows_of_its_step(hd, cache_dtype, cached, window, softcap):
    """Verifying [t, d1..d4] and decoding t alone give the same bits for t's row (and
    each draft's row equals decoding it after the previous ones), so speculative and
    plain decoding see identical attention outputs; with a sliding window (each row's keys
    start elsewhere) and a soft cap too. (An earlier kernel summed a key's score
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
    options = dict(sliding_window=window, logit_softcap=softcap)
    together = paged_attention(q, keys[cached:], values[cached:], kv_cache.clone(), meta, scale=0.125, **options)
    for i in range(new):
        ctx = cached + i + 1
        one = AttentionMetadata.build([1], [ctx], [table], BLOCK, cpu, cache_dtype=cache_dtype)
        alone = paged_attention(q[i:i + 1], keys[ctx - 1:ctx], values[ctx - 1:ctx], kv_cache, one, scale=0.125,
                                **options)
        assert torch.equal(alone[0], together[i]), f"row {i}"


@pytest.mark.skipif(not KERNEL_BUILDS, reason="the CPU attention kernel did not build here (no C compiler?)")
@pytest.mark.parametrize("hd", [64, 40])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, 5.0)])
def test_kernel_prompt_rows_do_not_depend_on_where_chunks_are_cut(hd, cache_dtype, threads, window, softcap):
    """A 150-token prompt attended whole, in chunks cut at several places, and one token at a
    time (as a decode step would), alongside other requests of other lengths: every row has
    the same bits each way, on 1 or 2 threads (with a sliding window and a soft cap too).
    This is what keeps a greedy answer the same whatever the token budget, the prefix cache
    or speculation did to its prefill."""
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
                                      torch.cat([other_kv, values[start:end]]), kv_cache, meta, scale=0.125,
                                      sliding_window=window, logit_softcap=softcap)
                rows.append(out[3:])
                start = end
            results.append(torch.cat(rows))
    finally:
        torch.set_num_threads(before)
    expected = positional_reference(q, keys.to(cache_dtype).float(), values.to(cache_dtype).float(),
                                    torch.arange(length), torch.arange(length), 0.125, window, softcap)
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


@pytest.mark.parametrize("path,cache_dtype", PATHS_AND_CACHES)
def test_tree_attention_matches_dense_reference(monkeypatch, path, cache_dtype):
    """A step with a tree of drafts, a chain verification and a prefill: the tree's rows see
    only their ancestors (and the cached context); the others are unaffected."""
    _use_path(monkeypatch, path, cache_dtype)
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
    assert (meta.kernel is not None) == (path == "kernel") and (meta.triton is not None) == (path == "triton")
    q = torch.randn(sum(n for _, n in shapes), heads, hd)
    out = paged_attention(q, torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)]),
                          torch.cat([v[c:] for v, (c, _) in zip(values, shapes)]), kv_cache, meta, scale=0.3)
    row = 0
    for i, ((cached, new), masks) in enumerate(zip(shapes, masks_per_req)):
        if masks is None:
            expected = reference_attention(q[row:row + new], keys[i], values[i], new, 0.3)
        else:
            expected = dense_tree_reference(q[row:row + new], keys[i], values[i], cached, masks, 0.3)
        torch.testing.assert_close(out[row:row + new], expected, rtol=1e-5, atol=1e-5)
        row += new


@pytest.mark.skipif(not KERNEL_BUILDS, reason="the CPU attention kernel did not build here (no C compiler?)")
@pytest.mark.parametrize("cached", [37, 44])  # the branch's keys land in a vector chunk / in the tail
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (30, None), (2, 2.0)])  # 2: the window ends in the tree
def test_kernel_tree_row_equals_its_branch_verified_as_a_chain(cached, cache_dtype, window, softcap):
    """Every node of a tree gets the same bits as the same branch verified as a chain,
    so greedy verification of any branch agrees with plain decoding token for token (a
    node's window starts from its depth's position, as the chain's row at that position)."""
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
    options = dict(sliding_window=window, logit_softcap=softcap)
    tree_out = paged_attention(q, keys[cached:], values[cached:], kv_cache.clone(), meta, scale=0.125, **options)
    for node in range(new):
        branch = [j for j in range(new) if masks[node] >> j & 1]   # root .. node, in order
        chain_meta = AttentionMetadata.build([len(branch)], [cached + len(branch)], [table], BLOCK, cpu,
                                             cache_dtype=cache_dtype)
        chain_out = paged_attention(q[branch], keys[cached:][branch], values[cached:][branch], kv_cache.clone(),
                                    chain_meta, scale=0.125, **options)
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


# ----------------------------------------------------------------- sliding window and soft cap
# Semantics as Hugging Face transformers computes them: a query at absolute position p sees key
# position j iff j <= p and p - j < window (masking_utils.sliding_window_overlay: kv_idx > q_idx
# - window); the soft cap is tanh(scores / cap) * cap on the scaled scores, before the mask
# (Gemma 2's eager attention).


def positional_reference(q, keys, values, q_pos, k_pos, scale, window=None, softcap=None, seen=None):
    """Dense attention of one request from absolute positions, in float64: q [n, Hq, hd] at
    positions q_pos [n]; keys/values [ctx, Hk, hd] at k_pos [ctx]; seen [n, ctx] bool: keys a
    row may see besides the causal and window rules (a tree's ancestry), None = all."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, ctx, hd]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale     # [Hq, n, ctx]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    distance = q_pos[:, None] - k_pos[None, :]                           # [n, ctx]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    if seen is not None:
        allowed &= seen
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v).transpose(0, 1).float()                           # [n, Hq, hd]


def _step_cache(shapes, kv_heads, hd, cache_dtype, num_blocks, seed):
    """A cache holding each request's first `cached` tokens; keys/values per request as the
    cache can hold them (float16-rounded for a float16 cache), new tokens included."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd), dtype=cache_dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, keys, values = [], [], []
    for cached, new in shapes:
        tables.append([perm.pop() for _ in range(-(-(cached + new) // BLOCK))])
        keys.append(torch.randn(cached + new, kv_heads, hd, generator=gen).to(cache_dtype).float())
        values.append(torch.randn(cached + new, kv_heads, hd, generator=gen).to(cache_dtype).float())
        for p in range(cached):
            kv_cache[0, :, tables[-1][p // BLOCK], p % BLOCK] = keys[-1][p]
            kv_cache[1, :, tables[-1][p // BLOCK], p % BLOCK] = values[-1][p]
    return kv_cache, tables, keys, values


def _use_path(monkeypatch, path, cache_dtype):
    """path: "kernel" (the compiled CPU kernel), "torch" (SDPA over gathered contexts) or
    "triton" (the GPU kernel, run by Triton's CPU interpreter)."""
    if path == "kernel" and not (KERNEL_BUILDS if cache_dtype == torch.float32 else KERNEL_READS_FP16):
        pytest.skip("the CPU attention kernel did not build here (no C compiler, or no F16C for float16)")
    assert path != "triton" or cache_dtype == torch.float32, "the Triton kernel reads a cache in the queries' dtype"
    if path in ("torch", "triton"):
        monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    if path == "triton":
        use_triton_interpreter(monkeypatch)


# (tokens already cached, new tokens): long decodes, a verification chain, prefill chunks the
# window cuts inside, a whole prompt longer than the window, short requests it never cuts.
WINDOW_SHAPES = [(60, 1), (40, 5), (20, 30), (0, 50), (3, 1), (0, 6), (90, 40), (33, 2)]
WINDOW_CASES = [(16, None), (None, 2.0), (7, 2.0), (1, None), (33, 20.0)]


@pytest.mark.parametrize("path,cache_dtype", PATHS_AND_CACHES)
@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
@pytest.mark.parametrize("group_cost", [0, 10**9])  # one SDPA call per request, or one for all
def test_window_and_softcap_match_the_positional_reference(monkeypatch, path, window, softcap, cache_dtype,
                                                           group_cost):
    """Both paths against dense attention computed from positions, over prefill (whole and
    chunked), decodes and a verification chain with contexts longer than the window."""
    _use_path(monkeypatch, path, cache_dtype)
    monkeypatch.setattr(attention, "GROUP_COST_IN_KEY_POSITIONS", group_cost)
    heads, kv_heads, hd = 6, 2, 40
    kv_cache, tables, keys, values = _step_cache(WINDOW_SHAPES, kv_heads, hd, cache_dtype, 120, seed=7)
    meta = AttentionMetadata.build([n for _, n in WINDOW_SHAPES], [c + n for c, n in WINDOW_SHAPES], tables, BLOCK,
                                   torch.device("cpu"), cache_dtype=cache_dtype)
    assert (meta.kernel is not None) == (path == "kernel") and (meta.triton is not None) == (path == "triton")
    q = torch.randn(sum(n for _, n in WINDOW_SHAPES), heads, hd, generator=torch.Generator().manual_seed(8))
    k_new = torch.cat([k[c:] for k, (c, _) in zip(keys, WINDOW_SHAPES)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(values, WINDOW_SHAPES)])
    out = paged_attention(q, k_new, v_new, kv_cache, meta, scale=0.3, sliding_window=window, logit_softcap=softcap)
    row = 0
    for i, (cached, new) in enumerate(WINDOW_SHAPES):
        ctx = cached + new
        expected = positional_reference(q[row:row + new], keys[i], values[i], torch.arange(cached, ctx),
                                        torch.arange(ctx), 0.3, window, softcap)
        torch.testing.assert_close(out[row:row + new], expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"req {i}: {m}")
        row += new


@pytest.mark.parametrize("path", ["torch", "kernel", "triton"])
def test_the_window_is_not_ignored(monkeypatch, path):
    """Rows whose context is longer than the window change with it (by far more than rounding);
    rows whose whole context fits in it do not change at all."""
    _use_path(monkeypatch, path, torch.float32)
    heads, kv_heads, hd, window = 6, 2, 16, 12
    shapes = [(60, 1), (40, 5), (0, 30), (4, 1), (0, 9)]
    kv_cache, tables, keys, values = _step_cache(shapes, kv_heads, hd, torch.float32, 60, seed=1)
    q = torch.randn(sum(n for _, n in shapes), heads, hd, generator=torch.Generator().manual_seed(2)) * 3
    k_new = torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(values, shapes)])
    outs = {}
    for w in (None, window):
        meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK,
                                       torch.device("cpu"))
        outs[w] = paged_attention(q, k_new, v_new, kv_cache.clone(), meta, scale=0.3, sliding_window=w)
    row = 0
    for cached, new in shapes:
        for i in range(new):
            position = cached + i
            full, windowed = outs[None][row + i], outs[window][row + i]
            if position < window:   # sees keys 0 .. position either way
                assert torch.equal(full, windowed), (cached, new, i)
            else:
                assert (full - windowed).abs().max() > 0.05, (cached, new, i)
        row += new


@pytest.mark.parametrize("length,window,cuts", [(37, 40, False), (37, 37, False), (37, 36, True), (18, 5, True)])
def test_fresh_prompts_keep_the_causal_path_unless_the_window_cuts(monkeypatch, length, window, cuts):
    """Whole prompts with nothing cached run SDPA's causal mode without a mask; a window shorter
    than the prompt cannot be said that way, so the group falls back to the masked call."""
    monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    heads, kv_heads, hd, num_reqs = 4, 2, 8, 2
    shapes = [(0, length)] * num_reqs
    kv_cache, tables, keys, values = _step_cache(shapes, kv_heads, hd, torch.float32, 40, seed=3)
    meta = AttentionMetadata.build([length] * num_reqs, [length] * num_reqs, tables, BLOCK, torch.device("cpu"))
    group = meta.groups[0]
    assert group.fresh
    q = torch.randn(num_reqs * length, heads, hd)
    out = paged_attention(q, torch.cat(keys), torch.cat(values), kv_cache, meta, scale=0.3, sliding_window=window)
    assert bool(group._grouped_masks) == cuts   # the masked call builds (and keeps) a mask
    for i in range(num_reqs):
        rows = slice(i * length, (i + 1) * length)
        expected = positional_reference(q[rows], keys[i], values[i], torch.arange(length), torch.arange(length),
                                        0.3, window)
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)


def test_layers_with_and_without_a_window_share_a_step():
    """Gemma's local and global layers: one metadata, masks built per window (and a window that
    cuts no context in a group reuses the global mask)."""
    heads, kv_heads, hd = 4, 2, 8
    shapes = [(30, 2), (2, 1)]
    kv_cache, tables, keys, values = _step_cache(shapes, kv_heads, hd, torch.float32, 20, seed=4)
    meta = AttentionMetadata.build([2, 1], [32, 3], tables, BLOCK, torch.device("cpu"))
    long_group = attention.ContextGroup.build([2], [32], torch.tensor([tables[0]]), BLOCK, None, torch.device("cpu"),
                                              torch.float32)
    assert long_group.window_that_cuts(8) == 8 and long_group.window_that_cuts(32) is None
    assert long_group.window_that_cuts(None) is None
    q = torch.randn(3, heads, hd)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(values, shapes)])
    for window in (8, None, 8, 4096):   # local, global, local, a window longer than every context
        out = paged_attention(q, k_new, v_new, kv_cache, meta, scale=0.3, sliding_window=window)
        expected = positional_reference(q[:2], keys[0], values[0], torch.arange(30, 32), torch.arange(32), 0.3,
                                        window)
        torch.testing.assert_close(out[:2], expected, rtol=1e-5, atol=1e-5)


def test_window_and_softcap_must_be_positive():
    meta = AttentionMetadata.build([1], [1], [[0]], BLOCK, torch.device("cpu"))
    kv_cache = torch.zeros(kv_cache_shape(1, BLOCK, 1, 8))
    q, kv = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, kv, kv, kv_cache, meta, 0.3, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        paged_attention(q, kv, kv, kv_cache, meta, 0.3, logit_softcap=0.0)


def _assert_rows_are_the_reference(out, q, shapes, masks_per_req, keys, values, scale, window, softcap):
    """Each request's rows of a step's attention output (shapes: (cached, new) per request; masks:
    a tree's, or None for a chain) equal the positional reference over its own keys and values."""
    row = 0
    for i, ((cached, new), masks) in enumerate(zip(shapes, masks_per_req)):
        if masks is None:
            q_pos, k_pos, seen = torch.arange(cached, cached + new), torch.arange(cached + new), None
        else:
            q_pos, k_pos, seen = _tree_positions(cached, masks)
        expected = positional_reference(q[row:row + new], keys[i], values[i], q_pos, k_pos, scale, window, softcap,
                                        seen)
        torch.testing.assert_close(out[row:row + new], expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"req {i}: {m}")
        row += new


def _tree_positions(cached, masks):
    """Absolute positions of a tree request's keys (cached, then its nodes at first new slot +
    depth) and the [new, ctx] ancestry its rows may see."""
    depths = [bin(m).count("1") - 1 for m in masks]
    new = len(masks)
    k_pos = torch.cat([torch.arange(cached), cached + torch.tensor(depths)])
    seen = torch.ones(new, cached + new, dtype=torch.bool)
    for i, m in enumerate(masks):
        seen[i, cached:] = torch.tensor([bool(m >> j & 1) for j in range(new)])
    return k_pos[cached:], k_pos, seen


# A deeper tree (depth 5) than TREE, so that a window of 3 ends among its nodes.
DEEP_TREE = [-1, 0, 1, 0, 3, 1, 5, 2, 7, 4, 9, 6]


@pytest.mark.parametrize("path,cache_dtype", PATHS_AND_CACHES)
@pytest.mark.parametrize("window,softcap", [(16, None), (9, 3.0), (3, None), (2, 3.0), (None, 3.0)])
def test_tree_with_a_window_matches_the_positional_reference(monkeypatch, path, window, softcap, cache_dtype):
    """A tree node's position is the first new slot + its depth, not its slot: the window starts
    from there, and among its ancestors (windows of 2 and 3 end inside the tree) it is applied
    at their positions too. Beside it in the step: a chain verification and a prefill chunk."""
    _use_path(monkeypatch, path, cache_dtype)
    heads, kv_heads, hd = 6, 2, 24
    _, tree_masks = attention.tree_layout(DEEP_TREE)
    shapes = [(40, len(DEEP_TREE)), (30, 4), (10, 23)]
    masks_per_req = [tree_masks, None, None]
    kv_cache, tables, keys, values = _step_cache(shapes, kv_heads, hd, cache_dtype, 60, seed=5)
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK,
                                   torch.device("cpu"), cache_dtype=cache_dtype, tree_masks=masks_per_req)
    assert (meta.kernel is not None) == (path == "kernel") and (meta.triton is not None) == (path == "triton")
    q = torch.randn(sum(n for _, n in shapes), heads, hd, generator=torch.Generator().manual_seed(6))
    out = paged_attention(q, torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)]),
                          torch.cat([v[c:] for v, (c, _) in zip(values, shapes)]), kv_cache, meta, scale=0.3,
                          sliding_window=window, logit_softcap=softcap)
    _assert_rows_are_the_reference(out, q, shapes, masks_per_req, keys, values, 0.3, window, softcap)


@pytest.mark.skipif(not KERNEL_BUILDS, reason="the CPU attention kernel did not build here (no C compiler?)")
@pytest.mark.parametrize("window,softcap", [(16, None), (3, 3.0), (None, 3.0), (40, 30.0)])
def test_kernel_agrees_with_the_pytorch_path(monkeypatch, window, softcap):
    """The compiled kernel and the PyTorch path give the same numbers to float32 rounding, for
    a step of decodes, chains, prefill chunks and a tree, with a window and a soft cap."""
    heads, kv_heads, hd = 8, 2, 64
    _, tree_masks = attention.tree_layout(DEEP_TREE)
    shapes = [(70, 1), (52, len(DEEP_TREE)), (44, 5), (0, 60), (25, 33)]
    masks_per_req = [None, tree_masks, None, None, None]
    kv_cache, tables, keys, values = _step_cache(shapes, kv_heads, hd, torch.float32, 100, seed=9)
    q = torch.randn(sum(n for _, n in shapes), heads, hd, generator=torch.Generator().manual_seed(10))
    k_new = torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(values, shapes)])
    outs = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
        meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK,
                                       torch.device("cpu"), tree_masks=masks_per_req)
        assert (meta.kernel is not None) == use_kernel
        outs.append(paged_attention(q, k_new, v_new, kv_cache.clone(), meta, scale=0.125, sliding_window=window,
                                    logit_softcap=softcap))
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(not KERNEL_BUILDS, reason="the CPU attention kernel did not build here (no C compiler?)")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_kernel_never_uses_keys_before_the_windows(cache_dtype):
    """Slots before every row's window may hold anything: here NaN in K and V, which any use
    (a score in the softmax, a zero weight times a value) would spread to the output."""
    if cache_dtype == torch.float16 and not KERNEL_READS_FP16:
        pytest.skip("this kernel build does not read float16 caches (no F16C)")
    heads, kv_heads, hd, window = 6, 2, 40, 20
    _, tree_masks = attention.tree_layout(DEEP_TREE)
    shapes = [(100, 1), (70, len(DEEP_TREE)), (61, 5), (50, 40)]
    masks_per_req = [None, tree_masks, None, None]
    kv_cache, tables, keys, values = _step_cache(shapes, kv_heads, hd, cache_dtype, 100, seed=11)
    for (cached, _), table in zip(shapes, tables):
        for p in range(cached - window + 1):   # before the window of the request's first new token
            kv_cache[:, :, table[p // BLOCK], p % BLOCK] = float("nan")
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK,
                                   torch.device("cpu"), cache_dtype=cache_dtype, tree_masks=masks_per_req)
    q = torch.randn(sum(n for _, n in shapes), heads, hd)
    out = paged_attention(q, torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)]),
                          torch.cat([v[c:] for v, (c, _) in zip(values, shapes)]), kv_cache, meta, scale=0.3,
                          sliding_window=window)
    assert torch.isfinite(out).all()
    _assert_rows_are_the_reference(out, q, shapes, masks_per_req, keys, values, 0.3, window, None)
