"""CPU weight buffers in transparent huge pages (Linux).

Why: a batch-1 decode step streams every weight once. In 4 KiB pages the 1.2 GB of a
1.5B model's packed weights are ~290,000 pages a token: a TLB miss and a page walk each
(a two-level walk in a virtual machine), and the hardware prefetcher's stream stops at
every page boundary. In 2 MiB pages they are ~600. Linux gives an anonymous mapping huge
pages when it is advised so (``MADV_HUGEPAGE``; the ``madvise`` mode most distributions
ship) and the pages are 2 MiB-aligned, which ``torch.empty`` does not ask for. Measured
on the development VM: decoding 0-3% faster, never slower (docs/benchmarks.md, "Quants
unpacked without widening, and weights in huge pages").

``SPECSERVE_HUGE_PAGES=off`` turns it off (the buffers are then ``torch.empty``'s).
Where the kernel has no transparent huge pages, or says ``never``, nothing changes.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import threading
import weakref

import torch

HUGE_PAGE_BYTES = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=1)
def _kernel_allows() -> bool:
    """True when the kernel can back an advised mapping with huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_SETTING) as fh:
            return "[never]" not in fh.read()
    except OSError:
        return False


def huge_pages_enabled() -> bool:
    return os.environ.get("SPECSERVE_HUGE_PAGES", "").lower() != "off" and _kernel_allows()


# Smaller tensors share 64 MiB regions (a 1.5B model's attention matrices are 1-2 MiB each):
# each starts on a cache line. The region being filled is held weakly: it is unmapped once no
# tensor in it lives, like any other.
REGION_BYTES = 64 << 20
_filling: list = [None, 0]   # [weak reference to the region's mapping, bytes handed out]
_filling_lock = threading.Lock()


def _advised_region(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A new anonymous mapping and its first nbytes from a 2 MiB boundary, advised huge, as a
    uint8 tensor (which holds the mapping alive)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES          # a multiple of the 4 KiB page size
    region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    return region, whole[offset : offset + nbytes]


def empty_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8, shared: bool = True) -> torch.Tensor:
    """An uninitialised CPU tensor in memory advised huge (``torch.empty``'s where huge pages are
    off). Tensors of a quarter region or more, and any with ``shared=False``, get a mapping of their
    own (unmapped when they die: for tensors that may not live as long as the model); smaller ones
    share a region. Pages are only touched, so resident, once written."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not huge_pages_enabled():
        return torch.empty(shape, dtype=dtype)
    if nbytes >= REGION_BYTES // 4 or not shared:
        return _advised_region(nbytes)[1].view(dtype).view(shape)
    with _filling_lock:
        ref, used = _filling
        region = ref() if ref is not None else None
        if region is None or used + nbytes > REGION_BYTES:
            region, used = _advised_region(REGION_BYTES)[0], 0
        whole = torch.frombuffer(region, dtype=torch.uint8)
        start = used + -whole.data_ptr() % HUGE_PAGE_BYTES
        _filling[:] = [weakref.ref(region), used + -(-nbytes // 64) * 64]
    return whole[start : start + nbytes].view(dtype).view(shape)


def cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` of CPU tensors in a mapping of its own (``shared=False``). A merged
    matrix (q, k, v; gate, up) is either what the kernels read or a copy that lives only until it is
    repacked for AMX; from the heap, such a copy would leave a hole that the packing, in mappings
    of its own, never reuses (the 1.5B's peak loading memory grew by ~300 MiB that way)."""
    out = empty_in_huge_pages((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), tensors[0].dtype,
                              shared=False)
    return torch.cat(tensors, out=out)
