"""The int8-activation kernel (``cpu_kernels/q8_act.h``): each format's product equals the
file's dequantized weights times the activations rounded as documented (8 bits per 256
values), rows are bitwise independent of the row count and the thread count, and cuts and
stacks keep the setting. Run on AVX-512 VNNI (``q8_act.h``) and on AVX2 (``q8_act_avx2.h``); each
case is skipped where its format has no kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.quantized import QuantizedMatrix

from test_quant_gemm import assert_rows_bitwise_independent, gguf_values, random_blocks

pytestmark = pytest.mark.skipif(
    not quant_gemm.available() or not quant_gemm.supports_int8_activations(int(T.Q4_1), 256),
    reason="no int8-activation kernel here (needs AVX-512 VNNI or AVX2)")


def formats(*qtypes):
    """Parameters for these formats, each skipped where this CPU's kernel lacks it."""
    return [pytest.param(q, id=q.name, marks=pytest.mark.skipif(
        not quant_gemm.available() or not quant_gemm.supports_int8_activations(int(q), 256),
        reason=f"no int8-activation kernel for {q.name} on this CPU")) for q in qtypes]


INT8_FORMATS = formats(T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: per 256 values (the last group may be shorter) d = max|x| / 127,
    q = round-half-even(x * (127 / max|x|)), xhat = d * q; float64."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for g in range(0, x.shape[1], 256):
        block = x[:, g : g + 256]
        amax = block.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        out[:, g : g + 256] = torch.round(block * inv).double() * (amax / 127).double()
    return out


def int8_matrix(qtype, out_features, in_features, seed=0):
    blocks = random_blocks(qtype, out_features, in_features, seed=seed)
    m = QuantizedMatrix.from_blocks(torch.from_numpy(blocks), int(qtype), in_features)
    m.int8_activations = True
    return m, gguf_values(blocks, qtype, in_features)


@pytest.mark.parametrize("qtype", INT8_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 6, 70])
def test_product_is_the_files_weights_times_the_rounded_activations(qtype, rows):
    in_features = 768 if qtype in (T.Q4_K, T.Q6_K) else 576   # 576: a last group of 64 values
    m, dense = int8_matrix(qtype, 38, in_features, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen) * torch.linspace(0.1, 3.0, in_features)
    bias = torch.randn(38, generator=gen)
    want = rounded_activations(x) @ dense.double().T + bias.double()
    got = m.matmul(x, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # and it is not the float32-activation product: the rounding is real
    exact = x.double() @ dense.double().T + bias.double()
    assert (got.double() - exact).abs().max() > 1e-4 * exact.abs().max()


@pytest.mark.parametrize("qtype", INT8_FORMATS)
def test_extreme_quants_scales_and_activations_do_not_overflow(qtype):
    """Every quant byte and scale byte 0x00 or 0xff (Q4_K: u = 15 and 6-bit scales and mins 63;
    Q6_K: q = 31 or -32 and int8 scales -1 or 127...), activations at +-max of their group (|xq| =
    127): the K-quant kernel's int16 reading of each chunk's byte products (q8k_tile) and its
    int32 super-block sums stay exact, so the product still equals the reference."""
    in_features = 768 if qtype in (T.Q4_K, T.Q6_K) else 576
    blocks = random_blocks(qtype, 12, in_features, seed=5)
    rng = np.random.default_rng(5)
    extreme = rng.integers(0, 2, size=blocks.shape).astype(np.uint8) * 255
    halves = {T.Q4_1: [0, 2], T.Q5_0: [0], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q6_K: [208]}[qtype]
    elems, nbytes = quant_gemm.block_geometry(int(qtype))
    per_row = in_features // elems
    keep = np.zeros(nbytes, dtype=bool)
    for off in halves:
        keep[off : off + 2] = True   # the float16 d / m stay finite, everything else is extreme
    tiled = np.tile(keep, per_row)
    blocks = np.where(tiled[None, :], blocks, extreme)
    blocks[:3] = np.where(tiled[None, :], blocks[:3], 255)   # rows of all-ones bytes
    blocks[3:6] = np.where(tiled[None, :], blocks[3:6], 0)
    m = QuantizedMatrix.from_blocks(torch.from_numpy(blocks), int(qtype), in_features)
    m.int8_activations = True
    dense = gguf_values(blocks, qtype, in_features)
    signs = torch.from_numpy(rng.integers(0, 2, size=(3, in_features)).astype(np.float32) * 2 - 1)
    x = torch.cat([torch.ones(1, in_features), -torch.ones(1, in_features), signs])
    want = x.double() @ dense.double().T   # |x| = max everywhere: the rounding is exact
    torch.testing.assert_close(m.matmul(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", INT8_FORMATS)
def test_rows_bitwise_independent_of_row_count_and_threads(qtype):
    m, _ = int8_matrix(qtype, 70, 512)
    assert_rows_bitwise_independent(m, (1, 2, 3, 5, 6, 7, 8, 9, 13, 64, 65, 110))   # AVX2 tiles: 8 rows


def test_cuts_and_stacks_keep_the_setting_and_unknown_formats_fall_back():
    m, dense = int8_matrix(T.Q4_K, 16, 512)
    plain = QuantizedMatrix.from_blocks(m.segments[0].data, int(T.Q4_K), 512)
    fused = QuantizedMatrix.cat([m, plain])
    for cut in (fused, m.row_slice(4, 8), m.col_slice(256, 256), m.pad_rows(3), m.contiguous()):
        assert cut.int8_activations
    assert not plain.int8_activations
    # Q5_K has no int8 kernel: the matrix multiplies as with float32 activations
    blocks = random_blocks(T.Q5_K, 8, 512)
    q5k = QuantizedMatrix.from_blocks(torch.from_numpy(blocks), int(T.Q5_K), 512)
    q5k.int8_activations = True
    assert q5k.kernel_qtype(q5k.segments[0]) == int(T.Q5_K)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(q5k.matmul(x).double(), x.double() @ gguf_values(blocks, T.Q5_K, 512).double().T,
                               rtol=1e-5, atol=1e-4)


# ---- int8 activations in pieces: int8_activations = N (2-4) ----

@pytest.mark.parametrize("qtype", INT8_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_three_pieces_give_the_float32_activation_product(qtype, rows):
    in_features = 768 if qtype in (T.Q4_K, T.Q6_K) else 576
    m, dense = int8_matrix(qtype, 38, in_features, seed=rows)
    m.int8_activations = 3
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen) * torch.linspace(0.1, 3.0, in_features)
    bias = torch.randn(38, generator=gen)
    want = x.double() @ dense.double().T + bias.double()   # the activations as given, not rounded
    got = m.matmul(x, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", formats(T.Q4_K, T.Q6_K, T.Q8_0))
def test_more_pieces_shrink_the_error_even_with_outlier_channels(qtype):
    """Each piece adds about 8 bits; with a 300x outlier in a group, 4 pieces are as close to the
    float64 product as the float32-activation kernel, within a few times its rounding (relative to
    sum |x w|, float32's error scale)."""
    m, dense = int8_matrix(qtype, 16, 512, seed=5)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(5))
    x[:, 7] *= 300
    want = x.double() @ dense.double().T
    scale = x.double().abs() @ dense.double().abs().T
    errors = []
    for pieces in (1, 2, 3, 4):
        m.int8_activations = pieces
        errors.append(((m.matmul(x).double() - want).abs() / scale).max().item())
    m.int8_activations = False
    float_error = ((m.matmul(x).double() - want).abs() / scale).max().item()
    assert errors[0] > 30 * errors[1] > 30 * 30 * errors[2], errors
    assert errors[3] <= 4 * float_error, (errors, float_error)


@pytest.mark.parametrize("qtype", formats(T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K))
def test_pieces_rows_bitwise_independent_of_row_count_and_threads(qtype):
    m, _ = int8_matrix(qtype, 70, 512)
    m.int8_activations = 3
    assert_rows_bitwise_independent(m, (1, 2, 3, 7, 64, 65, 110))


def test_piece_counts_outside_1_to_4_are_refused():
    with pytest.raises(ValueError, match="pieces must be 1 to 4"):
        quant_gemm.int8_activation_flags(5)
    from specserve.config import EngineConfig
    with pytest.raises(ValueError, match="number of pieces 1-4"):
        EngineConfig(int8_activations=5)
    assert EngineConfig(int8_activations=3).int8_activations == 3
