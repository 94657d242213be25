"""specserve's row-invariant fp16-weight matmul kernel: values, bitwise row and thread
invariance, building and falling back."""
import logging

import pytest
import torch

from specserve.model_executor.layers import cpu_gemm, kernel_build

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler or no F16C here")


@pytest.fixture
def fresh_loader(unbuilt_library):
    return unbuilt_library(cpu_gemm)


def _problem(out_features: int, in_features: int, rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).half()   # [out, in]
    bias = torch.randn(out_features, generator=gen)                                  # [out]
    x = torch.randn(rows, in_features, generator=gen)                                # [rows, in]
    return x, weight, bias


@needs_kernel
@pytest.mark.parametrize("shape", [(960, 576), (37, 64), (13, 1536)])   # out not a multiple of 4 included
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_a_float64_matmul_of_the_float16_weights(shape, with_bias):
    x, weight, bias = _problem(*shape, rows=53)
    bias = bias if with_bias else None
    got = cpu_gemm.fp16_weight_matmul(x, weight, bias)                               # [53, out]
    want = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    # float32 accumulation of in_features products: ~1e-6 relative to the terms' size
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * shape[1] ** 0.5)


@needs_kernel
@pytest.mark.parametrize("shape", [(960, 576), (37, 64), (13, 1536)])
def test_a_rows_bits_do_not_depend_on_its_call_or_the_thread_count(shape, monkeypatch):
    """Greedy verification equals plain decoding only if a row computed with drafts (or other
    requests) gets the bits it gets alone; row counts cross the kernel's row blocks (3 or 6)
    and row tiles (48), where its code path changes but its sums must not."""
    x, weight, bias = _problem(*shape, rows=110)
    alone = torch.cat([cpu_gemm.fp16_weight_matmul(x[j : j + 1], weight, bias) for j in range(len(x))])
    for rows in [2, 3, 4, 5, 6, 7, 12, 13, 47, 48, 49, 97, 110]:
        assert torch.equal(cpu_gemm.fp16_weight_matmul(x[:rows], weight, bias), alone[:rows]), f"{rows} rows"
    for threads in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        assert torch.equal(cpu_gemm.fp16_weight_matmul(x, weight, bias), alone), f"{threads} threads"


@needs_kernel
def test_strided_rows_and_empty_calls():
    x, weight, bias = _problem(64, 128, rows=9)
    fused = torch.cat([x, torch.randn(9, 32)], dim=1)[:, :128]         # a view with row stride 160
    assert torch.equal(cpu_gemm.fp16_weight_matmul(fused, weight, bias), cpu_gemm.fp16_weight_matmul(x, weight, bias))
    assert cpu_gemm.fp16_weight_matmul(x[:0], weight, bias).shape == (0, 64)
    batched = cpu_gemm.fp16_weight_matmul(x[:8].view(2, 4, 128), weight, bias)   # leading dims kept, as F.linear
    assert torch.equal(batched, cpu_gemm.fp16_weight_matmul(x[:8], weight, bias).view(2, 4, 64))


def test_without_a_compiler_fbgemm_is_used(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh_loader / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=kernel_build.__name__):
        assert not cpu_gemm.available() and not cpu_gemm.serves(576)
    assert "using fbgemm" in caplog.text


def test_the_environment_can_turn_the_kernel_off(fresh_loader, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_GEMM", "fbgemm")
    assert not cpu_gemm.available()
    assert not list(fresh_loader.rglob("*.so"))


def test_builds_into_the_cache_and_serves_widths_of_its_vector(fresh_loader):
    if not cpu_gemm.available():
        pytest.skip("no C compiler or no F16C here")
    assert len(list(fresh_loader.rglob("fp16_gemm-*.so"))) == 1
    assert cpu_gemm.serves(576) and cpu_gemm.serves(64)
    assert not cpu_gemm.serves(36)   # not a multiple of 8 (or 16): fbgemm takes it


@needs_kernel
def test_an_outputs_bits_do_not_depend_on_its_neighbours():
    """Outputs are reduced four at a time (lanes_sum4) or, at the end of the weight, one at a
    time (lanes_sum): the same additions, so an output's bits do not depend on where it sits,
    e.g. how tensor parallelism shards the weight."""
    x, weight, bias = _problem(37, 576, rows=7)
    whole = cpu_gemm.fp16_weight_matmul(x, weight, bias)                 # output 36 reduced alone
    shifted = cpu_gemm.fp16_weight_matmul(x, weight[33:], bias[33:])     # output 36 in a block of 4
    assert torch.equal(whole[:, 33:], shifted)
