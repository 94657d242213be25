"""Running specserve's Triton kernels on a CPU, through Triton's interpreter."""
import os

import pytest


def use_triton_interpreter(monkeypatch) -> None:
    """Attention on a CPU takes the GPU path's Triton kernel, run by Triton's CPU interpreter
    (``TRITON_INTERPRET=1``, set by tests/conftest.py before Triton loads where there is no GPU);
    skips the test where Triton is not installed or compiles for a GPU."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":   # tests/conftest.py sets it where there is no GPU
        pytest.skip("a CUDA machine: Triton compiles here, and tests/e2e/test_cuda.py runs the kernel on the GPU")
    monkeypatch.setenv("SPECSERVE_TRITON_ON_CPU", "1")
