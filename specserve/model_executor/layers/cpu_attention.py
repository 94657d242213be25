"""A compiled paged-attention kernel for float32 on CPUs, with the PyTorch path as fallback.

On a CPU the PyTorch attention path (``attention._attend_group``) gathers each
request's blocks into a padded copy and runs SDPA over it: the context is read
twice and SDPA pays a set-up cost per (head, request). At batch 16 that made
attention a third of a decode step. ``cpu_kernels/paged_attention.c`` reads each
request's K/V once through its block table instead.

The C file is compiled on first use (``kernel_build.LazyLibrary``) and
called through ctypes. It shares the (request, KV head) pairs out over
``torch.get_num_threads()`` OpenMP threads. Built with ``-fopenmp``, it links
``libgomp.so.1``, which resolves to the copy torch already loaded, so those are
torch's own workers, still spinning after the last matmul. (Two Python threads
measured no faster inside a real forward at batch 16: torch's workers spun on
the second core while the kernel ran.) At batch 16 this took a decode forward
from 142 to 116 ms (median; min 103 to 95) against one thread.
It serves every request of a step (decoding, verification and prefill chunks,
since 2026-12-02: a row's result then depends on its position alone, however its
prompt was cut) and writes the step's new K/V into the cache itself, each (request, KV
head) pair its own, instead of torch's two ``index_copy_`` of converted views:
faster per layer call than the PyTorch path (``specserve bench kernels`` measures both).
Without a compiler, when the build fails, or with
``SPECSERVE_CPU_ATTENTION=torch``, specserve uses the PyTorch path; results
agree to float32 rounding (tests/model_executor/layers/test_attention.py runs
both).
"""
from __future__ import annotations

import ctypes

import torch

from specserve.model_executor.layers.kernel_build import LazyLibrary

# Part of the cache key: a build with other flags is another file. -ffp-contract=off: the
# kernel's bitwise promises (a row's bits do not depend on the other rows of its step, nor a
# tree node's on the other branches) rest on every sum being computed exactly as written.
# With contraction GCC fused some multiply-adds into FMAs and not others, and a key's score
# differed in the last bit depending on which function computed it (the row-independence
# test at contexts 38 and 40 fails that way); the kernel now fuses its vector sums itself.
COMPILE_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off"]


def _setup(lib: ctypes.CDLL) -> None:
    fn = lib.specserve_paged_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    c_int, c_float = ctypes.c_int, ctypes.c_float
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, c_int, c_int, c_int, c_int, c_int, i64,
                   c_float, c_int, c_float, c_int, c_int, ptr, ptr, i64, ptr, i64, ptr]
    fn.restype = ctypes.c_int
    lib.specserve_paged_attention_has_f16.restype = ctypes.c_int


LIBRARY = LazyLibrary("paged_attention.c", COMPILE_FLAGS, _setup, "SPECSERVE_CPU_ATTENTION", "torch", "the PyTorch path")
_load = LIBRARY.get


def usable(device: torch.device | str, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> bool:
    """True where the kernel applies: CPU, float32 queries, a float32 or (with F16C)
    float16 KV cache (``cache_dtype``, default ``dtype``), and it built."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    if cache_dtype == torch.float16:
        return reads_float16_cache()
    return cache_dtype == torch.float32 and _load() is not None


def reads_float16_cache() -> bool:
    """True when the kernel built with F16C, so it reads a float16 KV cache directly."""
    lib = _load()
    return lib is not None and bool(lib.specserve_paged_attention_has_f16())


def paged_attention_cpu(
    q: torch.Tensor,             # [T, Hq, hd] float32; rows may be strided (a view of the fused qkv output)
    kv_cache: torch.Tensor,      # [2, Hk, num_blocks, block_size, hd] float32 or float16
    out: torch.Tensor,           # [T, Hq, hd] contiguous: the listed requests' rows are written
    block_tables: torch.Tensor,  # [B, max_blocks] int64, one row per listed request
    query_start: torch.Tensor,   # [B] int64: first row of each listed request in q and out
    query_lens: torch.Tensor,    # [B] int64
    context_lens: torch.Tensor,  # [B] int64 (new tokens included)
    scale: float,
    tree_masks: torch.Tensor | None = None,  # int32 tree descriptor (attention._tree_descriptor), or None
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """Attention of the listed requests' new rows. ``new_kv`` = (k [T, Hk, hd], v, slot_mapping [T])
    float32: the kernel first writes every listed request's new K/V into the cache (then q's rows
    must be exactly the listed requests' new tokens, in order). ``sliding_window``: a row at
    position p sees key position j only if p - j < sliding_window (a tree node's position: first
    new slot + depth); keys before a row's window are not read. ``logit_softcap``: scores =
    tanh(scores / cap) * cap after scaling, before the softmax. None: neither (see
    ``attention.paged_attention``)."""
    lib = _load()
    assert lib is not None, "call usable() first"
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    assert kv_cache.is_contiguous() and out.is_contiguous() and q.dtype == out.dtype == torch.float32
    assert kv_cache.dtype in (torch.float32, torch.float16)
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    num_reqs, num_heads = block_tables.shape[0], q.shape[1]
    args = (q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], query_start.data_ptr(), query_lens.data_ptr(),
            context_lens.data_ptr(), num_reqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale)
    masks = None
    if tree_masks is not None:
        words = int(tree_masks[0])
        assert tree_masks.dtype == torch.int32 and tree_masks.is_contiguous()
        assert tree_masks.shape[0] == 1 + num_reqs + q.shape[0] * words
        masks = tree_masks.data_ptr()
    write = (None, 0, None, 0, None)
    if new_kv is not None:
        k, v, slot_mapping = new_kv
        assert k.dtype == v.dtype == torch.float32 and k.shape[0] == v.shape[0] == q.shape[0]
        k = k if k.stride(2) == 1 and k.stride(1) == head_dim else k.contiguous()
        v = v if v.stride(2) == 1 and v.stride(1) == head_dim else v.contiguous()
        write = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr())
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
    window = min(sliding_window or 0, 2**31 - 1)   # 0: none (a window past any context changes nothing)
    status = lib.specserve_paged_attention(*args, window, logit_softcap or 0.0, torch.get_num_threads(),
                                           kv_cache.dtype == torch.float16, masks, *write)
    if status == -2:
        raise RuntimeError("this build of the paged attention kernel cannot read a float16 cache (no F16C)")
    if status:
        raise MemoryError("paged attention kernel: scratch allocation failed")
