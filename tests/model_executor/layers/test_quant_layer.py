"""The default model's GGUF-block layers in one compiled call per step (``QuantizedLayerStack``)
give the bits of the per-layer calls, logits and the K/V written: decoding, a draft chain and
a tree of drafts in one step, with a float32 and a float16 KV cache."""
from __future__ import annotations

import pytest
import torch

from specserve.model_executor.layers import cpu_attention, quant_gemm
from specserve.model_executor.loader import load_model
from specserve.worker.model_runner import ForwardInput, ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded():
    if not quant_gemm.available() or not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("the quantized matmul or the attention kernel did not build")
    return load_model(None, torch.float16, keep_quantized=True)


def _runner(loaded, cache_dtype: torch.dtype) -> ModelRunner:
    runner = ModelRunner(loaded.config, loaded.state_dict, torch.float16, torch.device("cpu"), 256, 16)
    runner.kv_cache_dtype = cache_dtype
    runner.allocate_kv_cache(12)
    return runner


def _step(runner, use_stack: bool, calls: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill two prompts, then one step: request 0 decodes a 4-draft chain, request 1 a tree;
    with or without the one-call stack throughout."""
    model = runner.model
    stack = model.layer_stack
    assert stack is not None, "the one-call path should be on for the default model on this CPU"
    real_run = stack.run

    def counting_run(*args, **kw):
        calls.append(use_stack)
        return real_run(*args, **kw)

    stack.run = counting_run
    a, b = list(range(300, 323)), list(range(500, 517))
    if not use_stack:
        model.layer_stack = None
    try:
        runner.execute([ForwardInput(a, 0, [0, 1], 0), ForwardInput(b, 0, [2, 3], 0)])  # prefill
        out = runner.execute([
            ForwardInput([900, 901, 902, 903, 904], len(a), [0, 1], 5),
            ForwardInput([700, 701, 702, 703, 704], len(b), [2, 3], 5, tree_parents=[-1, 0, 0, 1, 2]),
        ]).logits                                                                      # [10, V]
    finally:
        model.layer_stack = stack
        stack.run = real_run
    return out, [c.clone() for c in runner.kv_caches]


@pytest.mark.parametrize("cache", ["float32", "float16"])
def test_one_call_for_all_layers_has_the_bits_of_the_per_layer_calls(loaded, cache):
    if cache == "float16" and not cpu_attention.reads_float16_cache():
        pytest.skip("this build of the attention kernel reads no float16 cache")
    runner = _runner(loaded, getattr(torch, cache))
    assert runner.kv_caches[0].dtype == getattr(torch, cache)
    calls = []
    fused, fused_kv = _step(runner, True, calls)
    layered, layered_kv = _step(runner, False, calls)
    assert calls == [True, True]                            # the fused path ran twice, the other never
    assert torch.equal(fused, layered)
    assert all(torch.equal(x, y) for x, y in zip(fused_kv, layered_kv))
