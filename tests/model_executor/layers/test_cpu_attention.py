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
@pytest.mark.parametrize("window,softcap", [(None, None), (9, 4.0)])
def test_kernel_results_do_not_depend_on_the_thread_count(cache_dtype, window, softcap):
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
            cpu_attention.paged_attention_cpu(q, kv_cache, out, tables, starts, lens, ctx, 0.125,
                                              sliding_window=window, logit_softcap=softcap)
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


def _dense(q, kv_cache, tables, starts, lens, ctx, scale, window=None, softcap=None):
    """The step of _random_step by dense attention from positions, in float64."""
    _, kv_heads, _, block, hd = kv_cache.shape
    out = torch.empty_like(q)
    for b in range(len(lens)):
        n, c = int(lens[b]), int(ctx[b])
        slots = [int(tables[b][p // block]) * block + p % block for p in range(c)]
        k = kv_cache[0].reshape(kv_heads, -1, hd)[:, slots].double()            # [Hk, c, hd]
        v = kv_cache[1].reshape(kv_heads, -1, hd)[:, slots].double()
        rows = q[int(starts[b]):int(starts[b]) + n].double().transpose(0, 1)    # [Hq, n, hd]
        group = rows.shape[0] // kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = rows @ k.transpose(1, 2) * scale                                # [Hq, n, c]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        distance = torch.arange(c - n, c)[:, None] - torch.arange(c)[None, :]
        allowed = (distance >= 0) & (distance < (window or c + 1))
        out[int(starts[b]):int(starts[b]) + n] = (
            torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v).transpose(0, 1).float()
    return out


@pytest.mark.parametrize("window,softcap", [(None, 2.0), (17, None), (1, None), (5, 1.5)])
def test_window_and_softcap_through_the_ctypes_entry(window, softcap):
    """paged_attention_cpu itself (as benchmarks and the one-call layer stack reach the kernel):
    a row at position p sees positions p - window + 1 .. p, scores soft-capped after scaling."""
    if not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("no C compiler here")
    q, kv_cache, tables, starts, lens, ctx = _random_step(num_reqs=5)
    out = torch.zeros_like(q)
    cpu_attention.paged_attention_cpu(q, kv_cache, out, tables, starts, lens, ctx, 0.125, sliding_window=window,
                                      logit_softcap=softcap)
    torch.testing.assert_close(out, _dense(q, kv_cache, tables, starts, lens, ctx, 0.125, window, softcap),
                               rtol=1e-5, atol=1e-5)


def test_window_and_softcap_are_checked():
    if not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("no C compiler here")
    q, kv_cache, tables, starts, lens, ctx = _random_step(num_reqs=1)
    with pytest.raises(ValueError, match="sliding_window"):
        cpu_attention.paged_attention_cpu(q, kv_cache, torch.zeros_like(q), tables, starts, lens, ctx, 0.125,
                                          sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        cpu_attention.paged_attention_cpu(q, kv_cache, torch.zeros_like(q), tables, starts, lens, ctx, 0.125,
                                          logit_softcap=-1.0)
