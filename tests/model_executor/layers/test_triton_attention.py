"""The GPU path's Triton attention kernel, run by Triton's CPU interpreter: low-precision
dtypes, rows that do not depend on their step, and where it is (not) used. Its agreement with
the references for chains, trees, windows and soft caps is in test_attention.py and
test_wide_trees.py (the "triton" path)."""
from __future__ import annotations

import pytest
import torch

from specserve.model_executor.layers import cpu_attention, triton_attention
from specserve.model_executor.layers.attention import AttentionMetadata, kv_cache_shape, paged_attention

from triton_interpreter import use_triton_interpreter

BLOCK = 16
CPU = torch.device("cpu")


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    use_triton_interpreter(monkeypatch)


def _cache(shapes, kv_heads, hd, dtype, seed, num_blocks=40):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, kv_heads, hd), dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, keys, values = [], [], []
    for cached, new in shapes:
        tables.append([perm.pop() for _ in range(-(-(cached + new) // BLOCK))])
        keys.append(torch.randn(cached + new, kv_heads, hd, generator=gen).to(dtype))
        values.append(torch.randn(cached + new, kv_heads, hd, generator=gen).to(dtype))
        for p in range(cached):
            kv_cache[0, :, tables[-1][p // BLOCK], p % BLOCK] = keys[-1][p]
            kv_cache[1, :, tables[-1][p // BLOCK], p % BLOCK] = values[-1][p]
    return kv_cache, tables, keys, values


def _run(shapes, q, keys, values, kv_cache, tables, **kw):
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK, CPU,
                                   dtype=q.dtype, cache_dtype=kv_cache.dtype)
    assert meta.triton is not None and meta.kernel is None
    return paged_attention(q, torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)]),
                           torch.cat([v[c:] for v, (c, _) in zip(values, shapes)]), kv_cache, meta, scale=0.125, **kw)


@pytest.mark.parametrize("dtype", [torch.float16])
def test_low_precision_matches_a_float64_reference(triton_path, dtype):
    """float16 queries and cache (a GPU's dtype): a decode, a verification chain and a prefill
    chunk against dense float64 attention of the same rounded inputs. (Triton's interpreter has
    no bfloat16 arithmetic; tests/e2e/test_cuda.py runs bfloat16 on a GPU.)"""
    shapes = [(90, 1), (40, 5), (10, 70)]
    heads, kv_heads, hd = 8, 2, 64
    kv_cache, tables, keys, values = _cache(shapes, kv_heads, hd, dtype, seed=1)
    q = torch.randn(sum(n for _, n in shapes), heads, hd, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = _run(shapes, q, keys, values, kv_cache, tables)
    assert out.dtype == dtype
    row = 0
    for i, (cached, new) in enumerate(shapes):
        k = keys[i].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)   # [Hq, ctx, hd]
        v = values[i].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        scores = q[row:row + new].double().transpose(0, 1) @ k.transpose(1, 2) * 0.125   # [Hq, new, ctx]
        causal = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        expected = (torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v).transpose(0, 1)
        torch.testing.assert_close(out[row:row + new].double(), expected, rtol=2e-2, atol=2e-2)
        row += new


def test_a_row_does_not_depend_on_the_rest_of_its_step(triton_path):
    """A request's rows computed alone and beside others (more requests, longer query runs, so
    other tiles and grids) agree to float32 rounding: each program reads its own request only.
    (Not bitwise: the rows per program follow the step's longest query run, and a matrix unit's
    sums may round differently in another tile shape.)"""
    shapes = [(37, 3), (80, 1), (5, 40), (63, 5)]
    heads, kv_heads, hd = 6, 2, 32
    kv_cache, tables, keys, values = _cache(shapes, kv_heads, hd, torch.float32, seed=3)
    q = torch.randn(sum(n for _, n in shapes), heads, hd, generator=torch.Generator().manual_seed(4))
    together = _run(shapes, q, keys, values, kv_cache.clone(), tables)
    row = 0
    for i, (cached, new) in enumerate(shapes):
        alone = _run([shapes[i]], q[row:row + new], [keys[i]], [values[i]], kv_cache.clone(), [tables[i]])
        torch.testing.assert_close(alone, together[row:row + new], rtol=1e-6, atol=1e-6)
        row += new


def test_where_the_kernel_serves(monkeypatch):
    """A CUDA device with one dtype for queries and cache; a CPU only when asked (tests); never
    with SPECSERVE_GPU_ATTENTION=sdpa or without Triton."""
    monkeypatch.delenv("SPECSERVE_TRITON_ON_CPU", raising=False)
    monkeypatch.setattr(triton_attention, "_triton_importable", lambda: True)
    assert triton_attention.usable("cuda", torch.bfloat16)
    assert not triton_attention.usable("cuda", torch.float32, torch.float16)
    assert not triton_attention.usable("cuda", torch.int8)
    assert not triton_attention.usable("cpu", torch.float32)
    monkeypatch.setenv("SPECSERVE_GPU_ATTENTION", "sdpa")
    assert not triton_attention.usable("cuda", torch.bfloat16)
    monkeypatch.delenv("SPECSERVE_GPU_ATTENTION")
    monkeypatch.setattr(triton_attention, "_triton_importable", lambda: False)
    assert not triton_attention.usable("cuda", torch.bfloat16)


@pytest.mark.parametrize("query_len,group,expected", [(1, 1, 16), (1, 3, 16), (5, 3, 16), (5, 4, 32),
                                                      (13, 8, 64), (512, 2, 64)])
def test_rows_per_program(query_len, group, expected):
    assert triton_attention.block_m(query_len, group) == expected
