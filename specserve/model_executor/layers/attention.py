"""Paged attention over a flat batch of requests, in plain PyTorch.

The KV cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``
for K and the same for V; token t of a request lives in slot
``block_table[t // block_size] * block_size + t % block_size``.

A step's tokens come flat (``[T, ...]``): prefill chunks, single decode tokens
and [last token, draft 1..k] verification runs, in any mix. Attention gathers
each request's blocks through its block table and runs one
scaled-dot-product attention for the whole batch with queries padded to the
longest query run and a mask that is causal at each query's absolute position.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once per step, not per layer)."""

    slot_mapping: torch.Tensor      # [T] cache slot where each new token's K/V is written
    block_tables: torch.Tensor      # [B, max_blocks] block ids of each request (0-padded)
    token_to_padded: torch.Tensor   # [T] index of token t in the [B * max_q] padded query layout
    attn_mask: torch.Tensor         # [B, 1, max_q, max_blocks * block_size] additive: 0 = may attend, -inf = not
    max_query_len: int
    uniform: bool                   # every request has max_query_len new tokens: no padding needed
    _grouped_masks: dict = field(default_factory=dict, repr=False)

    def grouped_mask(self, group: int) -> torch.Tensor:
        """[B, 1, group * max_q, S]: ``attn_mask`` with its query rows repeated for
        ``group`` query heads per KV head (see ``paged_attention``); built once per step."""
        if group not in self._grouped_masks:
            self._grouped_masks[group] = self.attn_mask.repeat(1, 1, group, 1)
        return self._grouped_masks[group]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> "AttentionMetadata":
        """query_lens[b] new tokens of request b end at position context_lens[b] - 1."""
        num_reqs = len(query_lens)
        max_q = max(query_lens)
        max_blocks = max(-(-c // block_size) for c in context_lens)
        table = torch.zeros(num_reqs, max_blocks, dtype=torch.long)
        for b, blocks in enumerate(block_tables):
            n = -(-context_lens[b] // block_size)
            table[b, :n] = torch.tensor(blocks[:n], dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx_lens = torch.tensor(context_lens, dtype=torch.long)
        starts = ctx_lens - q_lens                                            # [B] first new position
        offsets = torch.arange(max_q)                                         # [max_q]
        q_pos = starts[:, None] + offsets[None, :]                            # [B, max_q]
        k_pos = torch.arange(max_blocks * block_size)                         # [S]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx_lens[:, None, None])
        # Flat token -> (request, offset) in the padded layout.
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens)  # [T]
        first_token = torch.cumsum(q_lens, 0) - q_lens
        offset_in_req = torch.arange(int(q_lens.sum())) - first_token[req_of_token]
        token_to_padded = req_of_token * max_q + offset_in_req
        # Slot of every new token.
        positions = q_pos.flatten()[token_to_padded]                          # [T]
        block_of_token = table[req_of_token, positions // block_size]
        slot_mapping = block_of_token * block_size + positions % block_size
        return cls(
            slot_mapping=slot_mapping.to(device),
            block_tables=table.to(device),
            token_to_padded=token_to_padded.to(device),
            # Additive, in the model dtype: SDPA would otherwise convert a boolean mask in every layer.
            attn_mask=torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")).unsqueeze(1).to(device),
            max_query_len=max_q,
            uniform=all(n == max_q for n in query_lens),
        )


def paged_attention(
    q: torch.Tensor,        # [T, Hq, hd]
    k: torch.Tensor,        # [T, Hk, hd]
    v: torch.Tensor,        # [T, Hk, hd]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, hd]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:          # [T, Hq, hd]
    """Grouped-query attention runs as plain attention per KV head: the ``group``
    query heads that share a KV head are stacked as extra query rows
    ([B, Hk, group * max_q, hd]), so no K/V is repeated per query head. On CPU
    this is ~2x faster than SDPA's ``enable_gqa`` for verification steps."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    # Write the new tokens' K/V, then read every request's whole context.
    k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v
    num_reqs, max_blocks = meta.block_tables.shape
    flat_table = meta.block_tables.view(-1)
    # index_select, not k_cache[block_tables]: the same gather, ~6x faster on CPU.
    keys = k_cache.index_select(0, flat_table).view(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, flat_table).view(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # keys/values: [B, Hk, S, hd]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    max_q = meta.max_query_len
    if meta.uniform:  # tokens are already laid out request by request, max_q each
        q_pad = q
    else:
        q_pad = q.new_zeros(num_reqs * max_q, num_heads, head_dim)
        q_pad[meta.token_to_padded] = q
    # [B * max_q, Hq, hd] -> [B, Hk, group * max_q, hd]; query head h uses KV head h // group.
    q_rows = (q_pad.view(num_reqs, max_q, num_kv_heads, group, head_dim)
              .permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group * max_q, head_dim))
    mask = meta.grouped_mask(group) if group > 1 else meta.attn_mask
    out = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=scale)
    # [B, Hk, group * max_q, hd] -> [B * max_q, Hq, hd]
    out = (out.view(num_reqs, num_kv_heads, group, max_q, head_dim)
           .permute(0, 3, 1, 2, 4).reshape(num_reqs * max_q, num_heads, head_dim))
    return out if meta.uniform else out[meta.token_to_padded]
