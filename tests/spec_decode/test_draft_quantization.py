"""draft_quantization: validated in the config, and QuantizedMatrix.requantize writes gguf's
own blocks of the file's values (the end-to-end losslessness check is in
tests/e2e/test_spec_decode.py::test_requantized_draft_is_lossless)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from specserve.config import SpeculativeConfig
from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.quantized import REQUANTIZE_FORMATS, QuantizedMatrix
from specserve.spec_decode.factory import requantize_draft

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model_executor" / "layers"))
from test_quant_gemm import random_blocks  # noqa: E402

needs_kernel = pytest.mark.skipif(not quant_gemm.available(), reason="the quantized matmul kernel did not build")


@pytest.mark.parametrize("bad", ["q4_k", "Q4_0", "int4", 4, True])
def test_draft_quantization_must_be_a_known_format(bad):
    with pytest.raises(ValueError, match="draft_quantization"):
        SpeculativeConfig(method="draft_model", model="/some/draft", draft_quantization=bad)


def test_draft_quantization_is_a_draft_model_option_and_names_the_kernels_formats():
    with pytest.raises(ValueError, match="draft_model option"):
        SpeculativeConfig(method="ngram", draft_quantization="q4_1")
    assert SpeculativeConfig(model="/some/draft", draft_quantization="q4_1").draft_quantization == "q4_1"
    assert SpeculativeConfig.DRAFT_QUANTIZATIONS == tuple(REQUANTIZE_FORMATS)


@needs_kernel
@pytest.mark.parametrize("name", sorted(REQUANTIZE_FORMATS))
def test_requantize_writes_ggufs_blocks_of_the_files_values(name):
    qtype = REQUANTIZE_FORMATS[name]
    k_rows = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(T.Q4_K, 6, 512, seed=1)), int(T.Q4_K), 512)
    q6_rows = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(T.Q6_K, 5, 512, seed=2)), int(T.Q6_K), 512)
    m = QuantizedMatrix.cat([k_rows, q6_rows])
    m.int8_activations = True
    values = m.dequantize().numpy()
    # three rows at a time: the pieces join into the same blocks as one call on every row
    got = m.requantize(qtype, rows_at_a_time=3)
    assert got.qtypes == [qtype, qtype] and got.shape == m.shape and got.int8_activations
    want = quants.quantize(values, T(qtype))
    assert np.array_equal(torch.cat([s.data for s in got.segments]).numpy(), want)
    torch.testing.assert_close(got.dequantize(), torch.from_numpy(quants.dequantize(want, T(qtype))), rtol=0, atol=0)
    # the values move by at most about a quantization step of the new format
    assert np.abs(got.dequantize().numpy() - values).max() <= np.abs(values).max() / (6 if qtype in (2, 3) else 14)


@needs_kernel
def test_requantize_keeps_segments_already_in_the_format_and_refuses_others():
    m = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(T.Q8_0, 4, 256)), int(T.Q8_0), 256)
    assert m.requantize(int(T.Q8_0)).segments[0] is m.segments[0]
    with pytest.raises(ValueError, match="cannot requantize"):
        m.requantize(int(T.Q4_K))


def test_requantizing_a_draft_without_gguf_blocks_is_a_clear_error():
    dense = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(dense)
    model.tp = SimpleNamespace(world_size=1)
    with pytest.raises(ValueError, match="GGUF draft"):
        requantize_draft(SimpleNamespace(model=model), "q4_1")
    model.tp = SimpleNamespace(world_size=2)
    with pytest.raises(ValueError, match="tensor-parallel size 1"):
        requantize_draft(SimpleNamespace(model=model), "q4_1")
