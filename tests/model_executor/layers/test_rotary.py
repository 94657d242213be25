"""Rotary tables against transformers' own rotary modules, for every rope type specserve reads."""
from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from specserve.model_executor.layers.rotary import RotaryEmbedding, apply_rotary

from model_families import config_of


def reference(module, positions: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos, sin [P, rotary_dim] for one sequence of ``positions`` tokens."""
    x = torch.zeros(1, positions, 8)
    cos, sin = module(x, torch.arange(positions)[None], **kwargs)
    return cos[0], sin[0]


def ours(table: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = table.lookup(positions, torch.float32)
    return cos[:, 0], sin[:, 0]


@pytest.mark.parametrize("family", ["llama", "llama3", "llama_linear", "llama_dynamic", "qwen2_yarn"])
def test_scaled_tables_equal_transformers(family):
    config = config_of(family)
    table = RotaryEmbedding.from_config(config, 200)
    ref_cos, ref_sin = reference(LlamaRotaryEmbedding(config), 200)
    cos, sin = ours(table, torch.arange(200))
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def test_gemma3_local_and_global_tables_differ_and_equal_transformers():
    config = config_of("gemma3")
    module = Gemma3RotaryEmbedding(config)
    tables = {}
    for layer_type in ("sliding_attention", "full_attention"):
        tables[layer_type] = ours(RotaryEmbedding.from_config(config, 100, layer_type), torch.arange(100))
        ref = reference(module, 100, layer_type=layer_type)
        torch.testing.assert_close(tables[layer_type], ref, atol=1e-6, rtol=0)
    assert (tables["sliding_attention"][0] - tables["full_attention"][0]).abs().max() > 0.1


def test_longrope_short_factors_inside_and_long_factors_past_the_original_context():
    """Phi-3's longrope: transformers picks the long factors for a whole sequence once it is longer
    than the original context; a KV cache keeps each position's rotation, so specserve uses the
    short factors below it and the long ones at and past it (what transformers computes for a
    sequence reaching those positions)."""
    config = config_of("phi3")
    original = config.rope_parameters["original_max_position_embeddings"]   # 128
    table = RotaryEmbedding.from_config(config, 250)
    module = Phi3RotaryEmbedding(config)
    assert table.rotary_dim == module.inv_freq.shape[0] * 2 < config.hidden_size // config.num_attention_heads
    short = reference(module, original)
    torch.testing.assert_close(ours(table, torch.arange(original)), short, atol=1e-6, rtol=0)
    long = reference(module, 250)
    torch.testing.assert_close(ours(table, torch.arange(original, 250)), tuple(t[original:] for t in long),
                               atol=1e-5, rtol=0)


def test_partial_rotary_leaves_the_other_dims_alone():
    x = torch.randn(5, 3, 16)                                           # [T, H, hd]
    cos, sin = torch.randn(5, 1, 8), torch.randn(5, 1, 8)               # rotary_dim 8
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    x1, x2 = x[..., :4], x[..., 4:8]
    torch.testing.assert_close(out[..., :8], x[..., :8] * cos + torch.cat((-x2, x1), -1) * sin)
