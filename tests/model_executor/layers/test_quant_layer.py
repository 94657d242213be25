"""The default model's GGUF-block layers in one compiled call per step (``QuantizedLayerStack``)
give the bits of the per-layer calls, logits and the K/V written: decoding, a draft chain and
a tree of drafts in one step, with a float32 and a float16 KV cache."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.model_executor.layers import cpu_attention, quant_gemm
from specserve.model_executor.loader import load_model
from specserve.worker.model_runner import ForwardInput, ModelRunner

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]   # the default model's weights


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


# ----------------------------------------------------------------- per-layer attention options
def _random_q8_0(out: int, in_features: int, gen: torch.Generator):
    """A random Q8_0 matrix: per 32 values a float16 scale and 32 int8 quants."""
    from specserve.model_executor.layers.quantized import QuantizedMatrix

    blocks = out * in_features // 32
    scales = (torch.randn(blocks, generator=gen) * 0.002).half().view(torch.uint8).view(blocks, 2)
    quants = torch.randint(0, 256, (blocks, 32), generator=gen, dtype=torch.uint8)
    return QuantizedMatrix.from_blocks(torch.cat([scales, quants], 1).reshape(out, -1), 8, in_features)


def _synthetic_layer(gen, window, softcap, hidden=128, heads=4, kv_heads=2, hd=32, inter=256):
    """What QuantizedLayerKernel reads of a decoder layer, with random Q8_0 weights; the
    attention module carries the layer's sliding_window and logit_softcap (Gemma-style)."""
    from types import SimpleNamespace as NS

    from specserve.model_executor.layers.norm import RMSNorm

    attn = NS(qkv_proj=NS(quantized=_random_q8_0((heads + 2 * kv_heads) * hd, hidden, gen), bias=None),
              o_proj=NS(quantized=_random_q8_0(hidden, heads * hd, gen)), num_heads=heads, num_kv_heads=kv_heads,
              head_dim=hd, sliding_window=window, logit_softcap=softcap, q_norm=None, k_norm=None, qk_norm=None)
    mlp = NS(gate_up_proj=NS(quantized=_random_q8_0(2 * inter, hidden, gen)),
             down_proj=NS(quantized=_random_q8_0(hidden, inter, gen)), activation="silu")
    norms = [RMSNorm(hidden, 1e-5) for _ in range(2)]
    for norm in norms:
        norm.load(1 + 0.1 * torch.randn(hidden, generator=gen))
    return NS(self_attn=attn, mlp=mlp, attn_norm=norms[0], mlp_norm=norms[1], attn_out_norm=None, mlp_out_norm=None,
              residual_scale=1.0)


def test_one_call_passes_each_layers_window_and_softcap():
    """Layers with different sliding windows and soft caps (local and global, as Gemma
    interleaves them): the one-call stack gives the bits of per-layer calls that pass each
    layer's options to paged_attention, over a prefill and a step with a chain and a tree;
    and the options matter (without them the output differs)."""
    from specserve.model_executor.layers.attention import (AttentionMetadata, kv_cache_shape, paged_attention,
                                                           tree_layout)
    from specserve.model_executor.layers.quant_layer import QuantizedLayerKernel, QuantizedLayerStack

    if not quant_gemm.available() or not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("the quantized matmul or the attention kernel did not build")
    options = [(6, None), (None, 5.0), (3, 2.0)]
    gen = torch.Generator().manual_seed(0)
    layers = [_synthetic_layer(gen, w, c) for w, c in options]
    hidden, heads, kv_heads, hd, block = 128, 4, 2, 32, 16
    cos, sin = torch.randn(64, hd // 2, generator=gen), torch.randn(64, hd // 2, generator=gen)
    rotary = SimpleNamespace(cos=cos, sin=sin, rotary_dim=hd)
    kernels = [QuantizedLayerKernel(layer, 1e-5, rotary) for layer in layers]
    assert [(k._struct.sliding_window, k._struct.attn_softcap) for k in kernels] == [(6, 0.0), (0, 5.0), (3, 2.0)]
    stack = QuantizedLayerStack.build(kernels)
    if stack is None:
        pytest.skip("the one-call path does not run on this build (no F16C?)")
    tables = [[0, 1, 2], [3, 4]]
    _, tree = tree_layout([-1, 0, 0, 1, 2])
    steps = [([30, 20], [30, 20], None), ([4, 5], [34, 25], [None, tree])]   # (query lens, context lens, trees)
    xs = [torch.randn(sum(q), hidden, generator=gen) for q, _, _ in steps]

    def run(kind):
        caches = [torch.zeros(kv_cache_shape(6, block, kv_heads, hd)) for _ in layers]
        outs = []
        for x, (q_lens, ctx_lens, trees) in zip(xs, steps):
            x = x.clone()
            positions = torch.tensor([p for q, c in zip(q_lens, ctx_lens) for p in range(c - q, c)])
            if trees:   # a tree node's position: first new slot + depth
                positions[4:] = 20 + torch.tensor([0, 1, 1, 2, 2])
            meta = AttentionMetadata.build(q_lens, ctx_lens, tables, block, torch.device("cpu"), tree_masks=trees)
            scratch, gate_up = torch.empty_like(x), torch.empty(x.shape[0], 2 * 256)
            if kind == "stack":
                stack.run(x, positions, caches, meta, hd**-0.5, scratch, gate_up)
            for kernel, cache, (window, softcap) in zip(kernels, caches, options):
                if kind == "stack":
                    break
                if kind == "no options":
                    window = softcap = None
                qkv = kernel.attn_in(x, positions, scratch)
                q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=1)
                out = paged_attention(q.view(-1, heads, hd), k.view(-1, kv_heads, hd), v.view(-1, kv_heads, hd),
                                      cache, meta, hd**-0.5, sliding_window=window, logit_softcap=softcap)
                kernel.mlp(x, out.reshape(x.shape[0], -1), scratch, gate_up)
            outs.append(x)
        return torch.cat(outs), caches

    stacked, stacked_kv = run("stack")
    layered, layered_kv = run("per layer")
    plain, _ = run("no options")
    assert torch.equal(stacked, layered)
    assert all(torch.equal(a, b) for a, b in zip(stacked_kv, layered_kv))
    assert not torch.allclose(stacked, plain, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------- every family's layers
def _q8_0_state(hf) -> dict:
    """The tiny model's tensors, every 2-D layer matrix as Q8_0 blocks (gguf's quantizer)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from specserve.model_executor.layers.quantized import QuantizedMatrix

    state = {}
    for name, t in hf.state_dict().items():
        t = t.detach().float()
        if t.dim() == 2 and name.startswith("model.layers."):
            blocks = quantize(t.numpy().astype(np.float32), GGMLQuantizationType.Q8_0)     # [out, row bytes] uint8
            state[name] = QuantizedMatrix.from_blocks(torch.from_numpy(np.ascontiguousarray(blocks)), 8, t.shape[1])
        else:
            state[name] = t.clone()
    return state


def _tiny_q8_0(family: str):
    """A tiny random model of ``family``: its config and its tensors with the layer matrices as Q8_0 (skips
    where the kernels did not build)."""
    from model_families import tiny_model

    if not quant_gemm.available() or not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("the quantized matmul or the attention kernel did not build")
    hf = tiny_model(family)
    hf.config.architectures = [type(hf).__name__]
    return hf.config, _q8_0_state(hf)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "gemma3", "gemma2", "phi3", "granite",
                                    "olmo2", "smollm3"])
def test_every_family_through_the_compiled_layers(family):
    """Each family's declared differences as quant_layer.c's parameters (q/k norms per head or over
    the projection, (1 + w) and branch-output norms, GELU-tanh, residual scale, partial and absent
    rotary, per-layer rotary tables and windows): logits close to the PyTorch path over the same
    Q8_0 weights; and a verified draft chain, batched with another request, gets exactly the bits
    of decoding alone (what lossless greedy speculation rests on)."""
    config, state = _tiny_q8_0(family)
    runner = ModelRunner(config, state, torch.float16, torch.device("cpu"), 256, 16)
    runner.allocate_kv_cache(16)
    assert runner.model.layer_kernels is not None and runner.model.layer_stack is not None
    reference = ModelRunner(config, state, torch.float16, torch.device("cpu"), 256, 16)
    reference.model.layer_kernels = reference.model.layer_stack = None   # the PyTorch path
    reference.allocate_kv_cache(16)
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    compiled = runner.execute([ForwardInput(tokens, 0, [0, 1, 2], 40)]).logits
    pytorch = reference.execute([ForwardInput(tokens, 0, [0, 1, 2], 40)]).logits
    assert pytorch.abs().max() > 1.0
    torch.testing.assert_close(compiled, pytorch, atol=1e-3, rtol=1e-3)   # K/V cached in float16 by both

    # Decode 5 tokens alone, one step each; then verify them as one chain beside another prefill.
    generated, alone, logits = [], [], compiled[-1:]
    for i in range(5):
        generated.append(int(logits[-1].argmax()))
        logits = runner.execute([ForwardInput(generated[-1:], 40 + i, [0, 1, 2], 1)]).logits
        alone.append(logits[0])
    runner.execute([ForwardInput(tokens, 0, [3, 4, 5], 0)])
    verified = runner.execute([ForwardInput(tokens[:17], 0, [6, 7], 1),
                               ForwardInput(generated, 40, [3, 4, 5], 5)]).logits[1:]
    assert torch.equal(verified, torch.stack(alone))


@pytest.mark.parametrize("family", ["llama3", "phi3"])
def test_lora_adapters_through_the_compiled_layers(family):
    """LoRA adapters in quant_layer.c (every matrix; Phi-3's fused q/k/v and gate/up): logits close
    to the PyTorch path with the same adapters; rows of two adapters and of none in one step (one
    call, each row its own adapter) get exactly the bits of their own steps; a verified chain with an
    adapter gets the bits of decoding alone with it."""
    from specserve.lora.peft_adapter import expected_shapes

    config, state = _tiny_q8_0(family)
    g = torch.Generator().manual_seed(5)
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if family == "phi3" else \
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = {aid: {(layer, proj): (0.2 * torch.randn(r, i, generator=g), 0.2 * torch.randn(o, r, generator=g))
                      for layer in range(config.num_hidden_layers) for proj, (o, i) in expected_shapes(config).items()
                      if proj in names}
                for aid, r in ((1, 4), (2, 8))}

    def runner(compiled: bool) -> ModelRunner:
        r = ModelRunner(config, state, torch.float16, torch.device("cpu"), 256, 16)
        if not compiled:
            r.model.layer_kernels = r.model.layer_stack = None
        r.enable_lora()
        for aid, modules in adapters.items():
            r.add_lora(aid, modules)
        r.allocate_kv_cache(32)
        return r

    fast, reference = runner(True), runner(False)
    assert fast.model.layer_kernels is not None
    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    for aid in (1, 2):
        compiled = fast.execute([ForwardInput(tokens, 0, [0, 1], 24, lora_id=aid)]).logits
        pytorch = reference.execute([ForwardInput(tokens, 0, [0, 1], 24, lora_id=aid)]).logits
        torch.testing.assert_close(compiled, pytorch, atol=2e-3, rtol=2e-3)
    base = fast.execute([ForwardInput(tokens, 0, [2, 3], 24)]).logits
    assert not torch.allclose(base, compiled, atol=1e-2)                 # the adapters matter
    alone = [fast.execute([ForwardInput(tokens, 0, [4 + 2 * i, 5 + 2 * i], 24, lora_id=aid)]).logits
             for i, aid in enumerate((1, 0, 2))]
    mixed = fast.execute([ForwardInput(tokens, 0, [10 + 2 * i, 11 + 2 * i], 24, lora_id=aid)
                          for i, aid in enumerate((1, 0, 2))]).logits
    assert torch.equal(mixed, torch.cat(alone))
    generated, singles, logits = [], [], alone[0][-1:]
    for i in range(4):                                                   # adapter 1, blocks 4-5, decoding alone
        generated.append(int(logits[-1].argmax()))
        logits = fast.execute([ForwardInput(generated[-1:], 24 + i, [4, 5], 1, lora_id=1)]).logits
        singles.append(logits[0])
    verified = fast.execute([ForwardInput(generated, 24, [10, 11], 4, lora_id=1),
                             ForwardInput(tokens[:5], 0, [16], 1)]).logits[:4]
    assert torch.equal(verified, torch.stack(singles))
