"""Running specserve's Triton kernels on a CPU, through Triton's interpreter."""
import os

import pytest


def use_triton_interpreter(monkeypatch) -> None:
    """Attention on a CPU takes the GPU path's Triton kernel, run by Triton's CPU interpreter
    (``TRITON_INTERPRET=1``, set by tests/conftest.py before Triton loads); skips the test where
    Triton is not installed."""
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET before Triton loads"
    monkeypatch.setenv("SPECSERVE_TRITON_ON_CPU", "1")
