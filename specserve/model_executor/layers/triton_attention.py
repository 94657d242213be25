"""Paged attention on GPUs through a Triton kernel (``triton_attention_kernel``) that reads K/V
through each request's block table, instead of gathering every request's context into a padded
copy for SDPA (``attention._attend_group``).

Why:
  - the gather copies each request's whole context in every layer, padded to the longest one
    in its group, and builds masks on the host: several kernel launches and host work per
    layer in a step that is already bound by the host on a GPU;
  - its shapes change with the context length, so a step cannot be captured once as a CUDA
    graph and replayed. Here every shape is fixed by the step's request count and query
    length; context lengths, block tables and tree masks are device tensors the kernel reads,
    so one captured graph serves any context (``worker/cuda_graphs.py``);
  - every request is read through its own block table by its own programs, with no padding
    to the step's longest context and no masks built on the host.

It serves every request of a step on CUDA: chains (prefill chunks, decode steps,
verification runs) and trees of drafts with ancestor masks of any width, sliding windows
and soft-capped logits. Where it does not apply the SDPA path runs: Triton missing,
``SPECSERVE_GPU_ATTENTION=sdpa``, or a sliding window no wider than a tree's span (whose
nodes' own positions the kernel does not compute).

Known limit: one program walks a request's whole context for its KV head, so a decode step of one
request has only (KV heads) programs; at long contexts and batch 1 most of a GPU's
multiprocessors idle. Splitting the context over programs and merging their softmax sums
(flash-decoding) is the next step if a measurement shows attention's share there.

On a CPU the tests run it through Triton's interpreter, which executes the same kernel source
on CPU tensors: ``TRITON_INTERPRET=1`` before Triton is first imported, and
``SPECSERVE_TRITON_ON_CPU=1`` to send a CPU's attention here.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

BLOCK_N = 64         # keys per step of a program's walk over the context
MAX_BLOCK_M = 64     # rows (tokens x query heads of one KV head) per program


def available() -> bool:
    """Triton importable and ``SPECSERVE_GPU_ATTENTION`` not ``sdpa``."""
    if os.environ.get("SPECSERVE_GPU_ATTENTION", "").lower() == "sdpa":
        return False
    return _triton_importable()


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def on_cpu() -> bool:
    """True when a CPU's attention takes this kernel, run by Triton's interpreter (tests)."""
    return os.environ.get("SPECSERVE_TRITON_ON_CPU", "") == "1" and os.environ.get("TRITON_INTERPRET", "") == "1"


def usable(device: torch.device | str, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> bool:
    """True where the kernel serves a step: a CUDA device (or a CPU, with ``on_cpu``), queries
    and cache of one floating dtype, Triton available."""
    device = torch.device(device)
    if cache_dtype is not None and cache_dtype != dtype:
        return False
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return (device.type == "cuda" or (device.type == "cpu" and on_cpu())) and available()


@dataclass
class TritonInputs:
    """What the kernel reads for a step: device tensors only, so that a CUDA graph replays
    with new values copied into the same tensors (``worker/cuda_graphs.py``)."""

    block_tables: torch.Tensor   # [B, max_blocks] int32, 0-padded
    query_start: torch.Tensor    # [B] int32: first row of each request in the flat batch
    query_lens: torch.Tensor     # [B] int32
    context_lens: torch.Tensor   # [B] int32
    positions: torch.Tensor      # [T] int64: each row's position (a tree node's: tree start + depth)
    max_query_len: int           # fixes the grid: the longest query run the step may hold
    tree_back: torch.Tensor | None = None    # [B] int32: a tree's first slot back from the first new one; -1: a chain
    tree_words: torch.Tensor | None = None   # [T, W] int32: each row's ancestor mask, 32 bits a word
    tree_span: int = 0                       # the widest tree's slots (back + new nodes), for the window check
    # Rows past a request's query run belong to no request (a captured graph's padding): the
    # output starts as zeros there, since the kernel writes each request's own rows only.
    padded: bool = False

    def serves_window(self, sliding_window: int | None) -> bool:
        """Whether the kernel computes this window exactly: no trees, or trees narrower than it."""
        return sliding_window is None or self.tree_words is None or sliding_window > self.tree_span


def block_m(max_query_len: int, group: int) -> int:
    """Rows per program: the request's rows (query len x group) rounded up to a power of two,
    at least 16 (``tl.dot``'s smallest tile), at most MAX_BLOCK_M."""
    rows = max(16, max_query_len * group)
    return min(MAX_BLOCK_M, 1 << (rows - 1).bit_length())


@functools.cache
def _kernel():
    from specserve.model_executor.layers import triton_attention_kernel

    return triton_attention_kernel.jit()


def paged_attention_triton(
    q: torch.Tensor,          # [T, Hq, hd]
    kv_cache: torch.Tensor,   # [2, Hk, num_blocks, block_size, hd], q's dtype; the step's K/V already written
    inputs: TritonInputs,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    out: torch.Tensor | None = None,   # [T, Hq, hd]
) -> torch.Tensor:            # [T, Hq, hd]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    assert kv_cache.stride(-1) == 1 and q.stride(-1) == 1, "the kernel reads head dims contiguously"
    assert inputs.serves_window(sliding_window), "a window no wider than a tree: use the SDPA path"
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.zeros_like(q) if inputs.padded else torch.empty_like(q)
    bm = block_m(inputs.max_query_len, group)
    num_reqs = inputs.query_lens.shape[0]
    grid = (num_reqs, num_kv_heads, -(-inputs.max_query_len * group // bm))
    tree = inputs.tree_words is not None
    dummy = inputs.query_lens   # stands for the tree tensors where there is no tree
    _kernel()[grid](
        q, out, kv_cache,
        inputs.block_tables, inputs.query_start, inputs.query_lens, inputs.context_lens, inputs.positions,
        inputs.tree_back if tree else dummy, inputs.tree_words if tree else dummy,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        inputs.block_tables.stride(0), inputs.tree_words.shape[1] if tree else 1,
        float(scale), float(logit_softcap or 1.0), int(sliding_window or 0),
        GROUP=group, HEAD_DIM=head_dim, HD_PAD=max(16, 1 << (head_dim - 1).bit_length()), BLOCK_SIZE=block_size,
        BLOCK_M=bm, BLOCK_N=BLOCK_N, HAS_TREE=tree, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None, IEEE=q.dtype == torch.float32,
    )
    return out
