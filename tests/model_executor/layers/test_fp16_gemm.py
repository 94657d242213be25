"""The CPU fp16-weight matmuls (specserve's kernel and the fbgemm fallback): the numbers of a
float32 matmul over float16-rounded weights, and a row's bits independent of its call."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.model_executor.layers import cpu_gemm, fp16_gemm
from specserve.model_executor.layers.fp16_gemm import (PackedFp16Weight, compute_dtype_for, cpu_fp16_gemm_available,
                                                      round_to_weight_dtype)
from specserve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from specserve.model_executor.layers.vocab import ParallelLMHead

needs_fbgemm = pytest.mark.skipif(not cpu_fp16_gemm_available("cpu"), reason="PyTorch built without fbgemm")


def rounded(w: torch.Tensor) -> torch.Tensor:
    return w.half().float()


@pytest.fixture(params=["kernel", "fbgemm"])
def gemm_path(request, monkeypatch):
    """PackedFp16Weight on specserve's kernel, or on fbgemm (where the kernel does not serve)."""
    if request.param == "kernel" and not cpu_gemm.available():
        pytest.skip("specserve's kernel did not build here")
    if request.param == "fbgemm":
        if not cpu_fp16_gemm_available("cpu") or not fp16_gemm.fbgemm_available():
            pytest.skip("PyTorch built without fbgemm")
        monkeypatch.setattr(cpu_gemm, "serves", lambda in_features: False)
    return request.param


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_packed_weight_matches_fp32_matmul_of_rounded_weights(rows, gemm_path):
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    packed = PackedFp16Weight(w, b)
    assert (packed._packed is None) == (gemm_path == "kernel")   # fbgemm's copy only when it is used
    got = packed(x)                                                            # [rows, 96]
    want = F.linear(x, rounded(w), b)  # fbgemm keeps the bias in float32
    # fp32 accumulation in another order: ~1e-6 relative; rounding the weights alone is ~1e-3.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert (got - F.linear(x, w, b)).abs().max() > 1e-4  # the weights really are float16


def _layers():
    torch.manual_seed(0)
    col = ColumnParallelLinear(64, [32, 16], bias=True)
    col.load([torch.randn(32, 64), torch.randn(16, 64)], [torch.randn(32), torch.randn(16)])
    row = RowParallelLinear(48, 64, bias=True)
    row.load(torch.randn(64, 48), torch.randn(64))
    head = ParallelLMHead(100, 64)
    head.load(torch.randn(100, 64))
    return col, row, head


def _outputs(col, row, head):
    torch.manual_seed(1)
    x64, x48 = torch.randn(3, 64), torch.randn(3, 48)
    return col(x64), row(x48), head.compute_logits(x64)


@pytest.mark.parametrize("use_fbgemm", [True, False])
def test_layers_after_rounding_compute_with_fp16_weights(monkeypatch, use_fbgemm):
    if use_fbgemm and not cpu_fp16_gemm_available("cpu"):
        pytest.skip("PyTorch built without fbgemm")
    if not use_fbgemm:  # CPUs without fbgemm: fp16-rounded values kept in float32
        monkeypatch.setattr(fp16_gemm, "cpu_fp16_gemm_available", lambda device: False)
    col, row, head = _layers()
    reference = [rounded(m.weight.data) for m in (col, row, head)]
    col_bias, row_bias = col.bias.data.clone(), row.bias.data.clone()  # biases stay float32
    for m in (col, row, head):
        round_to_weight_dtype(m, torch.float16, torch.float32, "cpu")
        assert (m.packed is not None) == use_fbgemm
    got = _outputs(col, row, head)
    torch.manual_seed(1)
    x64, x48 = torch.randn(3, 64), torch.randn(3, 48)
    want = (F.linear(x64, reference[0], col_bias), F.linear(x48, reference[1]) + row_bias,
            F.linear(x64, reference[2]))
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def test_compute_dtype():
    assert compute_dtype_for(torch.float16, "cpu") == torch.float32
    assert compute_dtype_for(torch.float16, "cuda") == torch.float16
    assert compute_dtype_for(torch.bfloat16, "cpu") == torch.bfloat16
    assert compute_dtype_for(torch.float32, "cpu") == torch.float32


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (1000, 576)])
def test_a_rows_bits_do_not_depend_on_the_rows_sharing_its_call(shape, gemm_path):
    """Greedy verification equals plain decoding only if a row computed with drafts (or other
    requests) gets the bits it gets alone. Unpadded, fbgemm's 1- and 2-row kernels differ in
    the last bits from its 3-6-row ones, so rows failed this at 1, 2, 7, 14, 31, 32, ... rows;
    specserve's kernel sums every row alike by construction."""
    if gemm_path == "fbgemm" and not fp16_gemm.exact_gemm():
        pytest.skip("SPECSERVE_EXACT_GEMM=0 turns the fbgemm path's padding off")
    out_features, in_features = shape
    torch.manual_seed(0)
    packed = PackedFp16Weight(torch.randn(out_features, in_features) * 0.05)
    x = torch.randn(140, in_features)                                         # [140, in]
    alone = torch.cat([packed(x[j : j + 1]) for j in range(len(x))])          # each row in its own call
    for rows in range(1, len(x) + 1):
        assert torch.equal(packed(x[:rows]), alone[:rows]), f"{rows} rows"


@needs_fbgemm
@pytest.mark.skipif(not fp16_gemm.exact_gemm(), reason="SPECSERVE_EXACT_GEMM=0")
def test_exact_row_count_pads_only_what_it_must():
    counts = [fp16_gemm.exact_row_count(m) for m in range(1, 9)]
    assert counts[0] >= 1 and all(c >= m for c, m in zip(counts, range(1, 9)))
    assert counts[2:6] == [3, 4, 5, 6]                    # 3-6 rows run as they are
    assert fp16_gemm.exact_row_count(fp16_gemm.EXACT_ROWS_LIMIT + 5) == fp16_gemm.EXACT_ROWS_LIMIT + 5


def test_the_exact_gemm_setting_is_read_when_used(monkeypatch):
    monkeypatch.setenv("SPECSERVE_EXACT_GEMM", "0")
    assert not fp16_gemm.exact_gemm() and fp16_gemm.exact_row_count(1) == 1
    monkeypatch.setenv("SPECSERVE_EXACT_GEMM", "1")
    assert fp16_gemm.exact_gemm()
