"""Tiny random-weight models of every family specserve supports, built with transformers.

Each builder returns a transformers ``*ForCausalLM`` in eval mode whose config exercises
what sets its family apart: rope scaling past the original context, sliding windows
shorter than the test prompts (16 tokens), q/k norms, Gemma's (1 + w) norms and soft-caps,
Granite's multipliers, Phi-3's fused weights and partial rotary, SmolLM3's NoPE layers.
Weights are re-drawn far from the init scale (``randomize_``) so a wrong part shows in the
logits.
"""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 16   # sliding windows in these models; test prompts are longer
VOCAB = 300

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (model_type, config overrides)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(rope_theta=500000.0)),
    "llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama_dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_yarn": ("qwen2", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "ministral": ("ministral", dict(sliding_window=WINDOW, head_dim=16,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3": ("gemma3_text", dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}})),
    "gemma2": ("gemma2", dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "phi3": ("phi3", dict(sliding_window=24, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.3, 2.0, 3.0], "long_factor": [1.0, 2.0, 4.0, 8.0],
        "original_max_position_embeddings": 128}, original_max_position_embeddings=128)),
    "granite": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                attention_multiplier=0.09, logits_scaling=2.0)),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0, 1], use_sliding_window=False)),
}
# Families whose layers attend through a sliding window shorter than the test prompts.
WINDOWED = ("mistral", "ministral", "gemma3", "gemma2", "phi3")


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights far from the init scale (std 0.02 makes every logit ~0 and every test trivially pass);
    norm weights away from their neutral value (1, or 0 for Gemma's 1 + w) so a forgotten one shows."""
    gen = torch.Generator().manual_seed(seed)
    offset_norms = model.config.model_type in ("gemma2", "gemma3_text")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((0.0 if offset_norms else 1.0) + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def config_of(family: str, **overrides):
    model_type, extra = FAMILIES[family]
    return AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})


def tiny_model(family: str, seed: int = 0, **overrides):
    """A transformers model of ``family`` with seeded random weights, eager attention, float32."""
    config = config_of(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    randomize_(model, seed + 1)
    return model
