"""The Triton kernel behind ``triton_attention``: paged attention read through block tables.

Imported only by ``triton_attention`` once Triton is known to be importable, so that the
rest of specserve never needs Triton. ``attention_kernel`` is the plain Python function;
``triton_attention`` wraps it with ``triton.jit`` on first use (Triton's CPU interpreter runs
it where ``TRITON_INTERPRET=1`` was set before Triton loaded: how the tests run it).

One program serves one request, one KV head and one tile of BLOCK_M query rows. Its rows
are the request's new tokens times the GROUP query heads that share the KV head (row m:
token m // GROUP, query head h * GROUP + m % GROUP), so K and V are read once per KV head
and never repeated per query head. It walks the request's context BLOCK_N keys at a time,
each key found through the block table, with an online softmax (running max and sum in
float32), and never materialises the scores of more than one BLOCK_N tile.

A key slot s is visible to the row of token i (slot first + i, where first = context_len -
query_len) when s < context_len and
  - the request is a chain: s <= first + i (causal);
  - the request is a tree starting at slot t = first - tree_back: s < t, or bit s - t of
    the row's ancestor mask (``tree_words``, 32-bit words) is set;
  - with a sliding window W: a key before the tree (or of a chain, whose positions are
    its slots) at s > position(i) - W; the caller sends trees through here only where W
    exceeds the tree's span, so a tree node's ancestors always lie inside the window.
"""
from __future__ import annotations

import triton
import triton.language as tl


def attention_kernel(
    q_ptr, out_ptr, cache_ptr,                  # q, out [T, Hq, hd]; cache [2, Hk, blocks, block_size, hd]
    block_tables_ptr, query_start_ptr, query_lens_ptr, context_lens_ptr, positions_ptr,
    tree_back_ptr, tree_words_ptr,              # [B] int32 (-1: a chain); [T, num_words] int32
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv, stride_ch, stride_cb, stride_cs,   # the cache's strides: K/V, head, block, slot
    stride_bt, num_words,
    scale, softcap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + b)
    ctx = tl.load(context_lens_ptr + b)
    q0 = tl.load(query_start_ptr + b)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)                       # [M] row within (tokens x group)
    row = m // GROUP                                                  # the request's new token
    head = h * GROUP + m % GROUP                                      # its query head
    row_ok = row < q_len
    d = tl.arange(0, HD_PAD)
    d_ok = d < HEAD_DIM
    tok = q0 + row                                                    # [M] row of the flat batch
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)      # [M, HD_PAD]
    first = ctx - q_len
    q_slot = first + row                                              # [M]
    tree_start = ctx                                                  # no key lies in a tree
    if HAS_TREE:
        back = tl.load(tree_back_ptr + b)
        tree_start = tl.where(back >= 0, first - back, ctx)
    if HAS_WINDOW:
        q_pos = tl.load(positions_ptr + tok, mask=row_ok, other=0)   # [M]
    # A tile reads up to its last row's slot (a tree node's ancestors come before it); a tile
    # with no rows of this request reads nothing.
    last_row = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // GROUP)
    end = (first + last_row + 1) * (tile * BLOCK_M < q_len * GROUP).to(tl.int32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD_PAD], tl.float32)
    k_base = cache_ptr + h * stride_ch
    v_base = cache_ptr + stride_kv + h * stride_ch
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)                             # [N] key slots
        n_ok = n < ctx
        block = tl.load(block_tables_ptr + b * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        offset = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs        # [N]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)     # [N, HD_PAD]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))                                # [M, N] float32
        s = s * scale
        if HAS_SOFTCAP:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * (s / softcap))) - 1.0)   # tanh(s / c) * c
        in_tree = n[None, :] >= tree_start                            # [1, N]
        visible = row_ok[:, None] & (n[None, :] <= q_slot[:, None]) & n_ok[None, :]
        if HAS_TREE:
            j = tl.maximum(n - tree_start, 0)                         # [N] the key's node in the tree
            word = tl.load(tree_words_ptr + tok[:, None] * num_words + (j // 32)[None, :],
                           mask=row_ok[:, None] & in_tree, other=0)   # [M, N]
            bit = (word >> (j % 32)[None, :]) & 1
            visible = visible & (~in_tree | (bit == 1))
        if HAS_WINDOW:
            visible = visible & (in_tree | (n[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # a row that has seen nothing yet
        p = tl.exp(s - m_safe[:, None])                               # [M, N]; 0 where hidden
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)     # [N, HD_PAD]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def jit():
    """The kernel for Triton: compiled for the GPU, or run by Triton's CPU interpreter."""
    return triton.jit(attention_kernel)
