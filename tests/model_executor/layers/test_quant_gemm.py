"""The GGUF block-format matmul kernel (quant_gemm.c): every format dequantizes to the values
of gguf's own dequantize, the matmul agrees with a float64 matmul of those values, and a row's
bits never depend on how many rows share its call or on the thread count."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.quantized import BlockAlignmentError, QuantizedMatrix

pytestmark = pytest.mark.skipif(not quant_gemm.available(), reason="the quantized matmul kernel did not build here")

FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of each block's float16 scale fields (everything else may be any byte).
_HALF_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
                T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def random_blocks(qtype: T, out: int, in_features: int, seed: int = 0) -> np.ndarray:
    """[out, row_bytes] uint8: random quants and scales, the scales finite float16 of a weight's size."""
    elems, nbytes = quant_gemm.block_geometry(int(qtype))
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out * in_features // elems, nbytes), dtype=np.uint8)
    for off in _HALF_FIELDS[qtype]:
        scales = (rng.standard_normal(blocks.shape[0]) * 0.02).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(out, -1)


def gguf_values(blocks: np.ndarray, qtype: T, in_features: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(blocks, qtype), dtype=np.float32).reshape(-1, in_features))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    blocks = random_blocks(qtype, 12, 512)
    m = QuantizedMatrix.from_blocks(torch.from_numpy(blocks), int(qtype), 512)
    assert torch.equal(m.dequantize(), gguf_values(blocks, qtype, 512))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 7, 50])
def test_matmul_matches_float64_reference(qtype, rows):
    out_features, in_features = 38, 768   # 38: the last two outputs run outside a 4-output block
    blocks = random_blocks(qtype, out_features, in_features, seed=rows)
    m = QuantizedMatrix.from_blocks(torch.from_numpy(blocks), int(qtype), in_features)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    want = x.double() @ gguf_values(blocks, qtype, in_features).double().T + bias.double()
    got = m.matmul(x, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_rows_bitwise_independent_of_row_count_and_threads(qtype):
    """Row counts on both sides of each switch of the fused path (AVX2: 2 outputs a pass up to 5
    rows, 1 up to 7; AVX-512: 4 up to 6), of the scratch rows' tiles (2 or 6 rows) and of the row
    tiles (48)."""
    out_features, in_features = 70, 512
    m = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(qtype, out_features, in_features)), int(qtype),
                                    in_features)
    assert_rows_bitwise_independent(m, (1, 2, 3, 5, 6, 7, 8, 9, 13, 48, 49, 110))


def assert_rows_bitwise_independent(m: QuantizedMatrix, row_counts) -> None:
    """Every call of the first n rows (n in row_counts, up to 110) on 1-3 threads gives each row the
    bits of that row multiplied alone."""
    x = torch.randn(110, m.in_features, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([m.matmul(x[i : i + 1]) for i in range(x.shape[0])])   # every row on its own
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for rows in row_counts:
                assert torch.equal(m.matmul(x[:rows]), alone[:rows]), (n_threads, rows)
    finally:
        torch.set_num_threads(threads)


def test_mixed_format_rows_and_cuts():
    """A fused matrix of two formats (q, k in Q4_K; v in Q6_K) and its tensor-parallel cuts."""
    in_features = 512
    parts = [(T.Q4_K, 24), (T.Q4_K, 8), (T.Q6_K, 8)]
    raw = [random_blocks(q, n, in_features, seed=i) for i, (q, n) in enumerate(parts)]
    mats = [QuantizedMatrix.from_blocks(torch.from_numpy(b), int(q), in_features) for b, (q, _) in zip(raw, parts)]
    fused = QuantizedMatrix.cat(mats)
    assert fused.qtypes == [int(T.Q4_K), int(T.Q6_K)] and fused.shape == (40, in_features)
    dense = torch.cat([gguf_values(b, q, in_features) for b, (q, _) in zip(raw, parts)])
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused.matmul(x), x @ dense.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(fused.row_slice(20, 16).dequantize(), dense[20:36])
    assert torch.equal(fused.col_slice(256, 256).dequantize(), dense[:, 256:])
    with pytest.raises(BlockAlignmentError):
        fused.col_slice(32, 480)   # Q4_K blocks hold 256 values
    assert torch.equal(fused.pad_rows(2).dequantize()[40:], torch.zeros(2, in_features))


def test_embedding_rows_and_bounds():
    blocks = random_blocks(T.Q8_0, 10, 64)
    m = QuantizedMatrix.from_blocks(torch.from_numpy(blocks), int(T.Q8_0), 64)
    ids = torch.tensor([3, 0, 9, 3])
    assert torch.equal(m.embedding(ids), gguf_values(blocks, T.Q8_0, 64)[ids])
    with pytest.raises(IndexError):
        m.embedding(torch.tensor([10]))


def test_unknown_format_is_not_supported():
    assert not quant_gemm.supports(int(T.Q2_K)) and not quant_gemm.supports(int(T.IQ4_NL))
    assert all(quant_gemm.supports(int(q)) for q in FORMATS)
