"""Building the compiled CPU attention kernel, and falling back when it cannot be built."""
import logging

import pytest
import torch

from specserve.model_executor.layers import cpu_attention, kernel_build


@pytest.fixture
def fresh_loader(unbuilt_library):
    return unbuilt_library(cpu_attention)


def test_without_a_compiler_the_pytorch_path_is_used(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh_loader / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=kernel_build.__name__):
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
    assert not cpu_attention.usable("cpu", torch.float32, torch.bfloat16)
    assert not cpu_attention.usable("meta", torch.float32)


def _random_step(num_reqs: int, kv_heads: int = 3, heads: int = 9, hd: int = 64, block: int = 16):
    """Several requests with decode and verify-sized steps over a shared random cache."""
    from specserve.model_executor.layers.attention import kv_cache_shape

    gen = torch.Generator().manual_seed(0)
    num_blocks = 8 * num_reqs
    kv_cache = torch.randn(kv_cache_shape(num_blocks, block, kv_heads, hd), generator=gen)
    query_lens = torch.tensor([1 + i % 6 for i in range(num_reqs)])
    context_lens = torch.tensor([40 + 7 * i for i in range(num_reqs)])
    block_tables = torch.randperm(num_blocks, generator=gen).view(num_reqs, 8)
    query_start = torch.cumsum(query_lens, 0) - query_lens
    q = torch.randn(int(query_lens.sum()), heads, hd, generator=gen)
    return q, kv_cache, block_tables, query_start, query_lens, context_lens


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_kernel_results_do_not_depend_on_the_thread_count(cache_dtype):
    """Each (request, KV head) pair is computed whole by one OpenMP thread."""
    if not cpu_attention.usable("cpu", torch.float32, cache_dtype):
        pytest.skip("no C compiler here (or no F16C for a float16 cache)")
    q, kv_cache, tables, starts, lens, ctx = _random_step(num_reqs=7)
    kv_cache = kv_cache.to(cache_dtype)
    outputs = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.zeros_like(q)
            cpu_attention.paged_attention_cpu(q, kv_cache, out, tables, starts, lens, ctx, 0.125)
            outputs.append(out)
    finally:
        torch.set_num_threads(previous)
    assert outputs[0].abs().sum() > 0
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_kernel_shares_torchs_openmp_runtime():
    """The kernel's OpenMP calls resolve to the libgomp torch loaded, so its threads are
    torch's workers, not a second spinning pool competing with them for the cores."""
    import ctypes
    from pathlib import Path

    torch_gomp = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*"))
    lib = cpu_attention._load() if cpu_attention.usable("cpu", torch.float32) else None
    if lib is None or not torch_gomp or not Path("/proc/self/maps").exists():
        pytest.skip("needs the kernel, a torch wheel bundling libgomp, and /proc")
    try:
        address = ctypes.cast(lib.omp_get_num_threads, ctypes.c_void_p).value
    except AttributeError:
        pytest.skip("the kernel was built without OpenMP here")
    with open("/proc/self/maps") as f:
        for line in f:
            span, *_, path = line.split()
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                break
    assert Path(path).resolve() in {p.resolve() for p in torch_gomp}, path
