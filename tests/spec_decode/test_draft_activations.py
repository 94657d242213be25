"""The draft's activations when ``draft_int8_activations`` is not set: int8, except where AMX tiles
multiply float32 activations (as fast at one row, faster at several); an explicit setting wins."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from specserve.model_executor.layers import quant_gemm
from specserve.spec_decode.factory import draft_uses_int8_activations


@pytest.mark.parametrize("amx", [True, False])
def test_default_follows_the_amx_tiles(monkeypatch, amx):
    monkeypatch.setattr(quant_gemm, "amx_tiles_available", lambda: amx)
    assert draft_uses_int8_activations(None) is (not amx)
    assert draft_uses_int8_activations(True) is True
    assert draft_uses_int8_activations(False) is False


def test_amx_tiles_available_is_the_q4_k_packing_check(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_AMX", "off")   # the switch that keeps every matrix off the tiles
    assert not quant_gemm.amx_tiles_available()
    monkeypatch.delenv("SPECSERVE_CPU_AMX")
    assert quant_gemm.amx_tiles_available() == quant_gemm.supports_amx(int(T.Q4_K), 16, 256)
