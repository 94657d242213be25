import pytest


@pytest.fixture
def unbuilt_library(monkeypatch, tmp_path):
    """unbuilt_library(kernel_module): that module's LazyLibrary has not tried to build yet and
    caches into an empty directory (returned)."""

    def reset(kernel_module):
        monkeypatch.setattr(kernel_module.LIBRARY, "library", None)
        monkeypatch.setattr(kernel_module.LIBRARY, "attempted", False)
        monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
        return tmp_path

    return reset
