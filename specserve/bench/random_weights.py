"""Published model shapes with random weights made on the device: what a forward costs for models
whose weights cannot be had here or cannot travel to a GPU machine (a step's time does not
depend on the weights' values, only on their shapes and dtype).

``shape_config("llama-3.1-8b")`` is the Hugging Face config of that shape; ``random_runner``
builds specserve's ``ModelRunner`` for it from weights drawn on the device, with its KV cache
(and CUDA graphs, unless ``enforce_eager``); ``random_hf_model`` builds transformers' model of
the same shape for the peer's timing.
"""
from __future__ import annotations

import torch

# name -> (transformers config class name, its arguments): the published configs' shapes.
SHAPES: dict[str, tuple[str, dict]] = {
    "llama-3.1-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2.5-1.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True)),
    "smollm2-135m": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True)),
    # tests: a shape that builds in a blink
    "tiny": ("LlamaConfig", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)),
}


def shape_config(name: str):
    """The transformers config of a shape in SHAPES."""
    import transformers

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    cls_name, kwargs = SHAPES[name]
    return getattr(transformers, cls_name)(**kwargs)


def random_state_dict(config, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the config's Hugging Face model, drawn on ``device``: matrices N(0, 0.02^2)
    (activations stay in range through the layers), norm weights 1, biases 0. The names and
    shapes come from transformers' model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, t in meta.state_dict().items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        if "norm" in name:
            out[name] = torch.ones(t.shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(t.shape, dtype=dtype, device=device)
        else:
            out[name] = (torch.randn(t.shape, generator=gen, device=device) * 0.02).to(dtype)
    return out


def random_runner(name: str, dtype: torch.dtype, device: torch.device | str, max_model_len: int,
                  kv_cache_memory: int, block_size: int = 16, enforce_eager: bool = False, max_num_reqs: int = 1,
                  max_query_len: int = 16, max_chain_steps: int = 0):
    """A ModelRunner of the shape with random weights and a KV cache of ``kv_cache_memory``
    bytes; its steps of up to ``max_num_reqs`` x ``max_query_len`` rows (and greedy chains of
    up to ``max_chain_steps`` steps) replay as CUDA graphs where they can, unless ``enforce_eager``."""
    from specserve.worker.model_runner import ModelRunner, allocate_kv_cache

    config = shape_config(name)
    runner = ModelRunner(config, random_state_dict(config, dtype, device), dtype, torch.device(device), max_model_len,
                         block_size)
    num_blocks = max(1, kv_cache_memory // runner.bytes_per_block)
    allocate_kv_cache(runner, num_blocks, not enforce_eager, max_num_reqs, max_query_len, max_tree_span=0,
                      max_chain_steps=max_chain_steps)
    return runner


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step reads from memory: every parameter but the input embedding
    table (one row of it is read), each storage once (a tied LM head counts)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def random_hf_model(name: str, dtype: torch.dtype, device: torch.device | str):
    """transformers' model of the shape, random weights initialised on ``device`` (the peer)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(name), dtype=dtype)
    return model.eval()
