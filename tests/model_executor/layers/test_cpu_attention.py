"""Building the compiled CPU attention kernel, and falling back when it cannot be built."""
import logging

import pytest
import torch

from specserve.model_executor.layers import cpu_attention


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A loader that has not tried to build yet, caching into an empty directory."""
    monkeypatch.setattr(cpu_attention, "_library", None)
    monkeypatch.setattr(cpu_attention, "_load_attempted", False)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_without_a_compiler_the_pytorch_path_is_used(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh_loader / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
        assert not cpu_attention.usable("cpu", torch.float32)
    assert "using the PyTorch path" in caplog.text


def test_the_environment_can_turn_the_kernel_off(fresh_loader, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_ATTENTION", "torch")
    assert not cpu_attention.usable("cpu", torch.float32)
    assert not list(fresh_loader.rglob("*.so"))


def test_builds_into_the_cache_and_only_serves_cpu_float32(fresh_loader):
    if not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("no C compiler here")
    assert len(list(fresh_loader.rglob("paged_attention-*.so"))) == 1
    assert not cpu_attention.usable("cpu", torch.bfloat16)
    assert not cpu_attention.usable("meta", torch.float32)
