"""The draft's activations when ``draft_int8_activations`` is not set: int8 (VNNI, AVX2 or AMX int8
tiles), except on an AMX CPU whose build lacks the int8 tiles, where the bfloat16 tiles beat the VNNI
kernel at several rows; an explicit setting wins."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from specserve.model_executor.layers import quant_gemm
from specserve.spec_decode.factory import draft_uses_int8_activations


@pytest.mark.parametrize("amx,int8_tiles,int8", [(False, False, True), (True, True, True), (True, False, False)])
def test_default_follows_the_tiles(monkeypatch, amx, int8_tiles, int8):
    monkeypatch.setattr(quant_gemm, "amx_tiles_available", lambda: amx)
    monkeypatch.setattr(quant_gemm, "amx_int8_tiles_available", lambda: int8_tiles)
    assert draft_uses_int8_activations(None) is int8
    assert draft_uses_int8_activations(True) is True
    assert draft_uses_int8_activations(False) is False


def test_amx_tiles_available_is_the_q4_k_packing_check(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_AMX", "off")   # the switch that keeps every matrix off the tiles
    assert not quant_gemm.amx_tiles_available()
    monkeypatch.delenv("SPECSERVE_CPU_AMX")
    assert quant_gemm.amx_tiles_available() == quant_gemm.supports_amx(int(T.Q4_K), 16, 256)
    assert quant_gemm.amx_int8_tiles_available() == quant_gemm.supports_amx_int8(int(T.Q4_K), 16, 256, 1)
