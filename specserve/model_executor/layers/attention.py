"""Paged attention over a flat batch of requests, in plain PyTorch.

The KV cache of one layer is ``[2, num_kv_heads, num_blocks, block_size, head_dim]``
(K, then V); token t of a request lives in slot
``block_table[t // block_size] * block_size + t % block_size`` of every head.
Heads come first so that one ``index_select`` over the block dimension gathers
K and V of a group already laid out ``[heads, requests, positions, head_dim]``,
contiguous as SDPA reads them (blocks first needs two gathers and hands SDPA
transposed views).

A step's tokens come flat (``[T, ...]``): prefill chunks, single decode tokens
and [last token, draft 1..k] verification runs, in any mix. Attention gathers
each request's blocks through its block table and runs scaled-dot-product
attention with queries padded to the longest query run and a mask that is
causal at each query's absolute position.

On a CPU with float32 queries the compiled kernel (``cpu_attention``) serves
every request of a step instead; each row's result there depends on its own
position alone, so chunked prefill, prefix caching, preemption and speculation
never change a token's bits (see docs/architecture.md, "Chunk boundaries").
On a GPU a Triton kernel (``triton_attention``) does the same through block
tables, with shapes fixed by the step's request count and query length alone, so
that CUDA graphs can replay it.

A verification run may also be a *tree* of drafts (several continuations
sharing prefixes, verified at once): its new tokens come with their parents
(``tree_parents``) and each attends to the cached context, its ancestors and
itself only; ``tree_layout`` turns parents into depths (for positions) and
ancestor masks. A draft growing a tree over several forwards has the tree's
earlier nodes cached: a request's tree may start ``back`` slots before its
first new token (``tree_back``), and its masks' bits then count from there.
Masks are Python integers of any width: a tree may hold any number of nodes
(the kernel reads them as 32-bit words, as many as the widest tree needs).

Two per-call options serve model families beyond Llama, exactly as Hugging Face
transformers computes them: ``sliding_window`` W (Mistral; Gemma 2/3's local layers,
interleaved with global ones, so it is an argument per call, i.e. per layer): a query
at absolute position p sees key position j iff j <= p and p - j < W
(``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``), W keys at most,
itself included; a tree node's position is its request's first new slot + its depth,
and the window applies to its ancestors at theirs. ``logit_softcap`` c (Gemma 2's
``attn_logit_softcapping``): scores = tanh(scale * q.k / c) * c, before the mask and
the softmax. With neither, nothing here costs more than without them.

Gathering pads every request's context to the longest one in its SDPA call, so
a batch that mixes short and long contexts would read mostly padding. Requests
are therefore split into *context groups* of similar length (sorted, then cut
where a separate call is cheaper than the padding it saves), one SDPA call per
group; a batch of similar lengths stays one group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.model_executor.layers import cpu_attention, triton_attention
from specserve.model_executor.layers.triton_attention import TritonInputs

# One more SDPA call (gathers, padding, launch) costs about as much as reading
# this many extra padded key positions; measured on CPU, where a padded key
# position costs ~0.3 us per layer and a group ~80 us.
GROUP_COST_IN_KEY_POSITIONS = 256


def split_by_context_length(context_lens: list[int], block_size: int, group_cost: int | None = None) -> list[list[int]]:
    """Request indices in groups that minimise padded key positions + group_cost per group.

    Requests are sorted by context length (in blocks) and cut into contiguous
    runs by dynamic programming over the sorted order: a run costs
    ``len(run) * longest_in_run + group_cost``. One group is returned as the
    requests in their original order.
    """
    if group_cost is None:
        group_cost = GROUP_COST_IN_KEY_POSITIONS
    padded = [-(-c // block_size) * block_size for c in context_lens]
    order = sorted(range(len(padded)), key=lambda i: padded[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n     # best[j]: cost of the first j sorted requests
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = padded[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    if len(groups) == 1:
        return [list(range(n))]
    return groups[::-1]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's paged KV cache: K and V, heads first (see the module docstring)."""
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


def kv_cache_dtype_for(weight_dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache's dtype: the weights' dtype where attention can read it.

    float16 weights on a CPU compute in float32 (see fp16_gemm); their K/V are
    stored in float16 when the compiled kernel reads float16 directly (F16C):
    half the bytes, and at batch 16 decoding reads every request's context
    from memory in every layer, so attention takes about half the time. K/V
    are rounded to float16 once, as on a GPU running the same model in float16;
    the PyTorch path (prefill) converts the gathered context back to float32.
    Everywhere else the cache is in the compute dtype.
    """
    if (weight_dtype == torch.float16 and compute_dtype == torch.float32 and torch.device(device).type == "cpu"
            and cpu_attention.reads_float16_cache()):
        return torch.float16
    return compute_dtype


def cache_slot(block_table: list[int], position: int, block_size: int) -> int:
    """The cache slot (in every head) of a request's token at ``position``."""
    return block_table[position // block_size] * block_size + position % block_size


def copy_cache_slots(kv_caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """K/V of cache slot src[i] -> slot dst[i] in every cache of ``kv_caches`` (each
    ``kv_cache_shape``), all sources read before any write."""
    if not kv_caches:
        return
    device = kv_caches[0].device
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=device)
    for cache in kv_caches:
        slots = cache.view(2, cache.shape[1], -1, cache.shape[4])   # [2, Hk, num_blocks * block_size, hd]
        slots.index_copy_(2, dst_t, slots.index_select(2, src_t))


def tree_layout(parents: list[int]) -> tuple[list[int], list[int]]:
    """Depths and ancestor bitmasks of a request's new tokens laid out as a tree.

    ``parents[i]`` is the index (among the new tokens) of token i's parent, or -1
    when its parent is the last cached token; parents come before children. Token i
    sits at position start + depth[i] and may attend to new token j iff bit j of
    mask[i] is set (its ancestors and itself). A chain [-1, 0, 1, ...] gives depths
    0, 1, 2, ... and the causal masks 1, 3, 7, ...
    """
    depths: list[int] = []
    masks: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree token {i} has parent {parent}: parents must come before their children")
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
        masks.append((masks[parent] if parent >= 0 else 0) | (1 << i))
    return depths, masks


@dataclass
class ContextGroup:
    """Requests attended in one SDPA call, padded to the group's longest context."""

    token_index: torch.Tensor | None  # [T_g] rows of the flat batch in this group; None = all rows, in order
    block_tables: torch.Tensor        # [B_g, max_blocks] block ids of each request (0-padded)
    token_to_padded: torch.Tensor     # [T_g] index of token t in the [B_g * max_q] padded query layout
    query_positions: torch.Tensor     # [B_g, max_q] absolute position of each (padded) query row
    context_lens: torch.Tensor        # [B_g]
    max_context_len: int              # the longest of context_lens
    block_size: int
    max_query_len: int
    uniform: bool                     # every request has max_query_len new tokens: no padding needed
    fresh: bool                       # ... and nothing cached before them: plain causal attention
    mask_dtype: torch.dtype
    tree_allowed: torch.Tensor | None = None  # [B_g, max_q, span] bool: row i may see tree slot j
    tree_back: torch.Tensor | None = None     # [B_g] the tree's first slot, back from the first new slot
    _grouped_masks: dict = field(default_factory=dict, repr=False)
    _context_buffers: dict = field(default_factory=dict, repr=False)

    def context_buffer(self, kv_cache: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[2, Hk, B_g * max_blocks, block_size, hd] in ``dtype`` (default the cache's):
        where every layer gathers this group's K/V (and, from a float16 cache, converts
        them). One buffer per dtype and step, reused by all layers: a fresh multi-MB
        tensor per layer costs page faults that made the gather ~2x slower on CPU."""
        dtype = kv_cache.dtype if dtype is None else dtype
        num_reqs, max_blocks = self.block_tables.shape
        shape = (2, kv_cache.shape[1], num_reqs * max_blocks, kv_cache.shape[3], kv_cache.shape[4])
        buf = self._context_buffers.get(dtype)
        if buf is None or buf.shape != shape:
            buf = self._context_buffers[dtype] = kv_cache.new_empty(shape, dtype=dtype)
        return buf

    def window_that_cuts(self, sliding_window: int | None) -> int | None:
        """``sliding_window`` where it hides a key from some row of the group, else None: a
        window no shorter than the longest context changes nothing, so such layers share the
        global layers' mask (and fresh prompts keep SDPA's causal mode)."""
        if sliding_window is None or sliding_window >= self.max_context_len:
            return None
        return sliding_window

    def grouped_mask(self, group: int, window: int | None = None) -> torch.Tensor:
        """[1, B_g, group * max_q, S] additive (0 = may attend, -inf = not), causal at each
        query's absolute position (and, with ``window``, only its last ``window`` positions),
        its query rows repeated for ``group`` query heads per KV head (see ``_attend_group``);
        built on first use, once per step and window (a group of fresh prompts never needs
        it). Additive, in the model dtype: SDPA would otherwise convert a boolean mask in
        every layer."""
        if (group, window) not in self._grouped_masks:
            allowed = self._allowed(window)                                             # [B_g, max_q, S]
            mask = torch.zeros(allowed.shape, dtype=self.mask_dtype).masked_fill_(~allowed, float("-inf"))
            self._grouped_masks[group, window] = mask.unsqueeze(1).repeat(1, 1, group, 1).transpose(0, 1).to(
                self.block_tables.device)
        return self._grouped_masks[group, window]

    def _allowed(self, window: int | None) -> torch.Tensor:
        """[B_g, max_q, S] bool: (padded) query row i of request b may see key slot s."""
        k_pos = torch.arange(self.block_tables.shape[1] * self.block_size)             # [S]
        q_pos = self.query_positions                                                    # [B_g, max_q] slots
        allowed = ((k_pos[None, None, :] <= q_pos[:, :, None])
                   & (k_pos[None, None, :] < self.context_lens[:, None, None]))               # [B_g, max_q, S]
        max_q = self.max_query_len
        k_abs = k_pos[None, None, :]                                                    # [1, 1, S]
        q_abs = q_pos                                                                   # [B_g, max_q]
        if self.tree_allowed is not None:
            span = self.tree_allowed.shape[2]
            tree_start = q_pos[:, :1] - self.tree_back[:, None]                         # [B_g, 1]
            rel = k_pos[None, :] - tree_start                                           # [B_g, S] slot - tree start
            in_tree = (rel >= 0) & (rel < span)
            tree_index = rel.clamp(0, span - 1)[:, None, :].expand(-1, max_q, -1)       # [B_g, max_q, S]
            seen = self.tree_allowed.gather(2, tree_index)
            allowed &= ~in_tree[:, None, :] | seen
            # Absolute positions are the slots, except for a tree's nodes: tree start + depth; an
            # ancestor's depth is the number of the row's mask bits below it (parents come first).
            depth = self.tree_allowed.sum(-1) - 1               # [B_g, max_q]; a causal request's rows: 0, 1, ...
            q_abs = tree_start + depth
            below = self.tree_allowed.cumsum(-1) - self.tree_allowed.long()             # [B_g, max_q, span]
            k_abs = torch.where(in_tree[:, None, :], tree_start[:, :, None] + below.gather(2, tree_index),
                                k_pos[None, None, :])                                   # [B_g, max_q, S]
        if window is not None:
            allowed &= k_abs > q_abs[:, :, None] - window       # transformers: kv_idx > q_idx - window
        return allowed

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], table: torch.Tensor, block_size: int,
              token_index: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
              tree_masks: list[list[int] | None] | None = None,
              tree_back: list[int] | None = None) -> "ContextGroup":
        """table: [B_g, max_blocks] block ids covering each request's context; tree_masks:
        per request the ancestor bitmasks of its new tokens (``tree_layout``), None = causal;
        tree_back: per request, its tree's first slot back from its first new slot (None: 0)."""
        num_reqs = len(query_lens)
        max_q = max(query_lens)
        tree_allowed = back = None
        if tree_masks is not None and any(m is not None for m in tree_masks):
            backs = [0 if tree_back is None or m is None else tree_back[b] for b, m in enumerate(tree_masks)]
            span = max(max_q, max(backs[b] + query_lens[b] for b in range(num_reqs)))
            tree_allowed = torch.zeros(num_reqs, max_q, span, dtype=torch.bool)
            tree_allowed[:, :, :max_q] = torch.ones(max_q, max_q, dtype=torch.bool).tril_()
            for b, masks in enumerate(tree_masks):
                if masks is not None:
                    tree_allowed[b, : len(masks)] = _mask_bits(masks, span)
            back = torch.tensor(backs, dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx_lens = torch.tensor(context_lens, dtype=torch.long)
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens)  # [T_g]
        first_token = torch.cumsum(q_lens, 0) - q_lens
        offset_in_req = torch.arange(int(q_lens.sum())) - first_token[req_of_token]
        return cls(
            token_index=None if token_index is None else token_index.to(device),
            block_tables=table.to(device),
            token_to_padded=(req_of_token * max_q + offset_in_req).to(device),
            query_positions=(ctx_lens - q_lens)[:, None] + torch.arange(max_q)[None, :],
            context_lens=ctx_lens,
            max_context_len=max(context_lens),
            block_size=block_size,
            max_query_len=max_q,
            uniform=all(n == max_q for n in query_lens),
            fresh=tree_allowed is None and all(n == max_q == c for n, c in zip(query_lens, context_lens)),
            mask_dtype=dtype,
            tree_allowed=tree_allowed,
            tree_back=back,
        )


def _mask_bits(masks: list[int], span: int) -> torch.Tensor:
    """[len(masks), span] bool: bit j of each (arbitrarily wide) mask."""
    words = _mask_words(masks, -(-span // 32))                                  # [n, W] int64 of 32 bits
    bits = torch.arange(span)
    return (words[:, bits // 32] >> (bits % 32)[None, :]) & 1 == 1


def _mask_words(masks: list[int], num_words: int) -> torch.Tensor:
    """[len(masks), num_words] int64: each mask cut into 32-bit words, lowest first."""
    return torch.tensor([[(m >> (32 * u)) & 0xFFFFFFFF for u in range(num_words)] for m in masks],
                        dtype=torch.long).reshape(len(masks), num_words)


def mask_words_int32(masks: list[int], num_words: int) -> torch.Tensor:
    """[len(masks), num_words] int32: the 32-bit words of ``_mask_words``, bit patterns kept
    (a word with its top bit set is negative), as the Triton kernel reads them."""
    return _as_int32(_mask_words(masks, num_words))


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values of 32 bits -> int32 with the same bit patterns (the top bit set: negative)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@dataclass
class KernelInputs:
    """What the compiled CPU kernel (``cpu_attention``) reads: every request of the step."""

    block_tables: torch.Tensor   # [B_k, max_blocks] int64, 0-padded
    query_start: torch.Tensor    # [B_k] int64: first row of each request's new tokens in the flat batch
    query_lens: torch.Tensor     # [B_k] int64
    context_lens: torch.Tensor   # [B_k] int64
    tree_masks: torch.Tensor | None = None  # int32 tree descriptor (trees in the step: ``_tree_descriptor``), else None


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once per step, not per layer).

    On a CPU with float32 queries (and a float32 or float16 cache), the compiled
    kernel serves every request of the step, prefill chunks included: each row's
    result is then fixed by its own position alone, so a prompt gives the same
    bits however it is cut into chunks, and a token the same bits whether it is
    decoded, verified or recomputed in a prefill. Elsewhere (GPUs, other dtypes,
    no compiler) requests go to SDPA in context groups, built on first use.
    """

    slot_mapping: torch.Tensor          # [T] cache slot where each new token's K/V is written
    kernel: KernelInputs | None         # the compiled CPU kernel's inputs, when it serves the step
    _group_args: tuple = field(repr=False)
    _groups: list[ContextGroup] | None = field(default=None, repr=False)
    triton: TritonInputs | None = None  # the Triton kernel's inputs (GPUs), when it serves the step

    @property
    def groups(self) -> list[ContextGroup]:
        """One SDPA call each; together they cover every token (steps the kernel does not serve)."""
        if self._groups is None:
            self._groups = _build_groups(*self._group_args)
        return self._groups

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        cache_dtype: torch.dtype | None = None,
        tree_masks: list[list[int] | None] | None = None,
        tree_back: list[int] | None = None,
    ) -> "AttentionMetadata":
        """query_lens[b] new tokens of request b fill slots context_lens[b] - query_lens[b] ..
        context_lens[b] - 1. ``dtype`` is the queries' dtype, ``cache_dtype`` the KV cache's
        (default: the same). ``tree_masks[b]``: request b's new tokens are nodes of a tree with
        these ancestor bitmasks (``tree_layout``; bit j = the tree's slot j); None (or a None
        entry) = causal. ``tree_back[b]``: the tree starts that many slots before request b's
        first new token (its earlier nodes cached; None: 0, the new tokens are the tree)."""
        if tree_masks is not None and all(m is None for m in tree_masks):
            tree_masks = tree_back = None
        # Slot of every new token (positions ctx - q_len .. ctx - 1 of its request).
        slots: list[int] = []
        token_start: list[int] = []
        for b, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
            token_start.append(len(slots))
            slots.extend(cache_slot(block_tables[b], p, block_size) for p in range(ctx - q_len, ctx))
        kernel = None
        if cpu_attention.usable(device, dtype, cache_dtype):
            everyone = list(range(len(query_lens)))
            kernel = KernelInputs(
                block_tables=_padded_block_table(block_tables, everyone, context_lens, block_size),
                query_start=torch.tensor(token_start, dtype=torch.long),
                query_lens=torch.tensor(query_lens, dtype=torch.long),
                context_lens=torch.tensor(context_lens, dtype=torch.long),
                tree_masks=None if tree_masks is None else _tree_descriptor(tree_masks, tree_back, query_lens),
            )
        triton = None
        if kernel is None and query_lens and triton_attention.usable(device, dtype, cache_dtype):
            triton = _triton_inputs(query_lens, context_lens, token_start, block_tables, block_size, device,
                                    tree_masks, tree_back)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
            kernel=kernel,
            _group_args=(len(query_lens), query_lens, context_lens, token_start, block_tables,
                         block_size, device, dtype, tree_masks, tree_back),
            triton=triton,
        )


def _triton_inputs(query_lens: list[int], context_lens: list[int], token_start: list[int],
                   block_tables: list[list[int]], block_size: int, device: torch.device,
                   tree_masks: list[list[int] | None] | None, tree_back: list[int] | None) -> TritonInputs:
    """The Triton kernel's device tensors for a step (``AttentionMetadata.build``'s arguments)."""
    positions: list[int] = []
    backs: list[int] = []
    for b, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
        masks = None if tree_masks is None else tree_masks[b]
        if masks is None:
            positions.extend(range(ctx - q_len, ctx))
            backs.append(-1)
        else:   # a node's mask holds its ancestors and itself: its depth is the bit count - 1
            back = 0 if tree_back is None else tree_back[b]
            positions.extend(ctx - q_len - back + m.bit_count() - 1 for m in masks)
            backs.append(back)
    tree_words = back_t = None
    span = 0
    if tree_masks is not None:
        span = max(len(m) + back for m, back in zip(tree_masks, backs) if m is not None)
        rows: list[int] = []
        for masks, q_len in zip(tree_masks, query_lens):
            rows.extend(masks if masks is not None else [0] * q_len)
        tree_words = mask_words_int32(rows, -(-span // 32)).to(device)
        back_t = torch.tensor(backs, dtype=torch.int32).to(device)
    everyone = list(range(len(query_lens)))
    table = _padded_block_table(block_tables, everyone, context_lens, block_size)
    return TritonInputs(
        block_tables=table.to(torch.int32).to(device),
        query_start=torch.tensor(token_start, dtype=torch.int32).to(device),
        query_lens=torch.tensor(query_lens, dtype=torch.int32).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
        positions=torch.tensor(positions, dtype=torch.long).to(device),
        max_query_len=max(query_lens),
        tree_back=back_t, tree_words=tree_words, tree_span=span,
    )


# tree_back of a request without a tree in a step with trees (the kernel's NO_TREE).
_NO_TREE = 0xFFFFFFFF


def _tree_descriptor(tree_masks: list[list[int] | None], tree_back: list[int] | None,
                     query_lens: list[int]) -> torch.Tensor:
    """The kernel's int32 tree buffer (cpu_kernels/paged_attention.c's header): [W, back per
    request (NO_TREE: causal), each row's mask in W 32-bit words]; W fits the widest tree."""
    backs = [_NO_TREE if m is None else (0 if tree_back is None else tree_back[b]) for b, m in enumerate(tree_masks)]
    widest = max(m.bit_length() for masks in tree_masks if masks is not None for m in masks)
    words = max(1, -(-widest // 32))
    rows: list[int] = []
    for masks, q_len in zip(tree_masks, query_lens):
        rows.extend(masks if masks is not None else [0] * q_len)
    return _as_int32(torch.cat([torch.tensor([words] + backs, dtype=torch.long), _mask_words(rows, words).view(-1)]))


def _padded_block_table(block_tables: list[list[int]], members: list[int], context_lens: list[int],
                        block_size: int) -> torch.Tensor:
    """[len(members), max blocks] the blocks covering each member's context, 0-padded."""
    num_blocks = [-(-context_lens[b] // block_size) for b in members]
    table = torch.zeros(len(members), max(num_blocks), dtype=torch.long)
    for row, (b, n) in enumerate(zip(members, num_blocks)):
        table[row, :n] = torch.tensor(block_tables[b][:n], dtype=torch.long)
    return table


def _build_groups(num_requests, query_lens, context_lens, token_start, block_tables,
                  block_size, device, dtype, tree_masks, tree_back) -> list[ContextGroup]:
    """Context groups over the step's requests."""
    if not num_requests:
        return []
    split = split_by_context_length(context_lens, block_size)
    groups = []
    for members in split:
        table = _padded_block_table(block_tables, members, context_lens, block_size)
        token_index = None  # None: the group is the whole step, rows in order
        if len(split) > 1:
            token_index = torch.tensor(
                [token_start[b] + i for b in members for i in range(query_lens[b])], dtype=torch.long
            )
        groups.append(ContextGroup.build(
            [query_lens[b] for b in members], [context_lens[b] for b in members],
            table, block_size, token_index, device, dtype,
            None if tree_masks is None else [tree_masks[b] for b in members],
            None if tree_back is None else [tree_back[b] for b in members],
        ))
    return groups


def paged_attention(
    q: torch.Tensor,         # [T, Hq, hd]
    k: torch.Tensor,         # [T, Hk, hd]
    v: torch.Tensor,         # [T, Hk, hd]
    kv_cache: torch.Tensor,  # [2, Hk, num_blocks, block_size, hd], q's dtype or (CPU) float16
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:           # [T, Hq, hd]
    """Writes the step's new K/V into ``kv_cache``, then attends every new token to its
    request's context. ``sliding_window`` (a query at position p sees keys at p - W + 1 .. p)
    and ``logit_softcap`` (scores = tanh(scores / c) * c) are this layer's, as in the module
    docstring; None: plain causal attention."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
    kn = meta.kernel
    if kn is not None:
        # The kernel writes the new tokens' K/V itself, then attends.
        out = q.new_empty(q.shape)
        cpu_attention.paged_attention_cpu(q, kv_cache, out, kn.block_tables, kn.query_start, kn.query_lens,
                                          kn.context_lens, scale, kn.tree_masks, (k, v, meta.slot_mapping),
                                          sliding_window, logit_softcap)
        return out
    # Write the new tokens' K/V, then read every request's whole context.
    slots = kv_cache.view(2, num_kv_heads, -1, head_dim)   # [2, Hk, num_blocks * block_size, hd]
    slots[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
    slots[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))
    if meta.triton is not None and meta.triton.serves_window(sliding_window):
        return triton_attention.paged_attention_triton(q, kv_cache, meta.triton, scale, sliding_window, logit_softcap)
    if len(meta.groups) == 1:
        return _attend_group(q, kv_cache, meta.groups[0], scale, sliding_window, logit_softcap)
    out = q.new_empty(q.shape)
    for g in meta.groups:
        out.index_copy_(0, g.token_index, _attend_group(q.index_select(0, g.token_index), kv_cache, g, scale,
                                                        sliding_window, logit_softcap))
    return out


def _attend_group(
    q: torch.Tensor,         # [T_g, Hq, hd] the group's query rows
    kv_cache: torch.Tensor,  # [2, Hk, num_blocks, block_size, hd]
    g: ContextGroup,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:           # [T_g, Hq, hd]
    """Grouped-query attention runs as plain attention per KV head: the ``group``
    query heads that share a KV head are stacked as extra query rows
    ([Hk, B, group * max_q, hd]), so no K/V is repeated per query head. On CPU
    this is ~2x faster than SDPA's ``enable_gqa`` for verification steps."""
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
    num_reqs, max_blocks = g.block_tables.shape
    # One gather for K and V: [2, Hk, B * max_blocks, block_size, hd] -> [2, Hk, B, S, hd].
    # (index_select, not kv_cache[:, :, table]: the same gather, several times faster on CPU.)
    context = torch.index_select(kv_cache, 2, g.block_tables.view(-1), out=g.context_buffer(kv_cache))
    if context.dtype != q.dtype:  # a float16 cache read by float32 queries
        context = g.context_buffer(kv_cache, q.dtype).copy_(context)
    context = context.view(2, num_kv_heads, num_reqs, -1, head_dim)
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    max_q = g.max_query_len
    window = g.window_that_cuts(sliding_window)
    if g.fresh and window is None and logit_softcap is None:
        # Whole prompts with no cached prefix: query i sees keys 0..i, which SDPA's own causal
        # mode computes without a mask and skipping the masked blocks (a third faster than the
        # masked call for a 780-token prompt on CPU). Keys past the prompt (the last block's
        # padding) lie above the diagonal, so they are never seen.
        q_heads = q.view(num_reqs, max_q, num_heads, head_dim).transpose(1, 2)   # [B, Hq, T, hd]
        out = F.scaled_dot_product_attention(q_heads, context[0].transpose(0, 1), context[1].transpose(0, 1),
                                             is_causal=True, scale=scale, enable_gqa=group > 1)
        return out.transpose(1, 2).reshape(num_reqs * max_q, num_heads, head_dim)
    if g.uniform:  # tokens are already laid out request by request, max_q each
        q_pad = q
    else:
        q_pad = q.new_zeros(num_reqs * max_q, num_heads, head_dim)
        q_pad[g.token_to_padded] = q
    # [B * max_q, Hq, hd] -> [Hk, B, group * max_q, hd]; query head h uses KV head h // group.
    q_rows = (q_pad.view(num_reqs, max_q, num_kv_heads, group, head_dim)
              .permute(2, 0, 3, 1, 4).reshape(num_kv_heads, num_reqs, group * max_q, head_dim))
    mask = g.grouped_mask(group, window)
    if logit_softcap is None:
        out = F.scaled_dot_product_attention(q_rows, context[0], context[1], attn_mask=mask, scale=scale)
    else:
        out = _softcapped_attention(q_rows, context[0], context[1], mask, scale, logit_softcap)
    # [Hk, B, group * max_q, hd] -> [B * max_q, Hq, hd]
    out = (out.view(num_kv_heads, num_reqs, group, max_q, head_dim)
           .permute(1, 3, 0, 2, 4).reshape(num_reqs * max_q, num_heads, head_dim))
    return out if g.uniform else out[g.token_to_padded]


# At most this many float32 scores at once in _softcapped_attention (256 MiB).
SOFTCAP_SCORES_PER_SLICE = 1 << 26


def _softcapped_attention(
    q: torch.Tensor,         # [Hk, B, R, hd] query rows (R = group * max_q)
    k: torch.Tensor,         # [Hk, B, S, hd]
    v: torch.Tensor,         # [Hk, B, S, hd]
    mask: torch.Tensor,      # [1, B, R, S] additive
    scale: float,
    softcap: float,
) -> torch.Tensor:           # [Hk, B, R, hd]
    """SDPA with Gemma 2's soft cap, which SDPA cannot express: scores computed explicitly as
    transformers' eager attention does (q.k * scale, then tanh(s / cap) * cap, then the mask),
    softmax in float32, then the values. The scores of a long prefill do not fit at once
    ([Hk, B, R, S]), so query rows go in slices of at most SOFTCAP_SCORES_PER_SLICE scores."""
    out = torch.empty_like(q)
    rows = max(1, SOFTCAP_SCORES_PER_SLICE // (k.shape[0] * k.shape[1] * k.shape[2]))
    keys = k.transpose(-1, -2)                                                       # [Hk, B, hd, S]
    for r0 in range(0, q.shape[2], rows):
        r1 = min(r0 + rows, q.shape[2])
        scores = torch.matmul(q[:, :, r0:r1], keys).float().mul_(scale)             # [Hk, B, r, S]
        scores.div_(softcap).tanh_().mul_(softcap).add_(mask[:, :, r0:r1])
        out[:, :, r0:r1] = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    return out
