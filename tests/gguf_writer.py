"""Write a transformers model as a GGUF file the way llama.cpp's converter does.

What ``convert_hf_to_gguf.py`` (ggml-org/llama.cpp; ``conversion/`` in current versions)
writes for each architecture, written here independently of specserve's reader:

- tensor names from gguf-py's own ``TensorNameMap`` (not specserve's table);
- llama.cpp's q/k row permutation for the architectures it permutes (llama, granite,
  smollm3: ``LlamaModel.permute``), Gemma's norms stored as ``1 + w``;
- norms and 1-D tensors in F32, the matrices in the asked type (F32, or a block format such
  as Q8_0 through ``gguf.quants.quantize``, token embedding and output included, as
  ``--outtype q8_0`` does);
- the metadata keys each converter class sets (``TextModel.set_gguf_parameters`` and the
  family's override), and the extra tensors: Llama 3's ``rope_freqs``, Phi-3's
  ``rope_factors_long`` / ``rope_factors_short``;
- the tokenizer metadata copied from another GGUF file (the default model's), so the model's
  vocabulary size must be that file's.

Two places where this writes what the config means rather than what one converter version
reads from a transformers-5 ``config.to_dict()``: rope parameters are read from
``config.rope_parameters`` (older converters read ``rope_theta`` / ``rope_scaling``; current
ones the same dict), and Llama 3's ``rope_freqs`` use the rope parameters'
``original_max_position_embeddings`` (the converter takes a top-level one, defaulting to
8192, Llama 3.x's value).

Mistral checkpoints are written as ``llama`` (as llama.cpp does: no sliding window), unless
``arch="mistral"`` asks for the architecture transformers' GGUF support also reads.
"""
from __future__ import annotations

import copy
import functools
import math

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, MODEL_ARCH, RopeScalingType, get_tensor_name_map
from gguf.quants import dequantize, quantize

# Hugging Face model_type -> general.architecture llama.cpp writes
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3", "phi3": "phi3", "granite": "granite", "olmo2": "olmo2", "smollm3": "smollm3"}
_PERMUTED = ("llama", "mistral", "granite", "smollm3")   # LlamaModel and its subclasses (undo_permute)
_NORM_SHIFTED = ("gemma2", "gemma3")
_LLAMA_MODEL = ("llama", "mistral", "granite", "smollm3")  # LlamaModel.set_gguf_parameters' extra keys
_MODEL_ARCH = {"llama": MODEL_ARCH.LLAMA, "mistral": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2,
               "qwen3": MODEL_ARCH.QWEN3, "gemma2": MODEL_ARCH.GEMMA2, "gemma3": MODEL_ARCH.GEMMA3,
               "phi3": MODEL_ARCH.PHI3, "granite": MODEL_ARCH.GRANITE, "olmo2": MODEL_ARCH.OLMO2,
               "smollm3": MODEL_ARCH.SMOLLM3}
F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0


def write_gguf(model, path, tokenizer_gguf: str | None, qtype: GGMLQuantizationType = F32,
               arch: str | None = None) -> str:
    """Write ``model`` (a transformers ``*ForCausalLM``) to ``path`` with the tokenizer metadata of
    ``tokenizer_gguf`` (None: a placeholder vocabulary of the model's size, enough for reading
    the config); matrices in ``qtype``. Returns ``path`` as a string."""
    config = model.config
    arch = arch or GGUF_ARCH[config.model_type]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {config.model_type}")
    _write_parameters(writer, config, arch)
    writer.add_file_type(0 if qtype == F32 else 7)   # LlamaFileType ALL_F32 / MOSTLY_Q8_0
    if tokenizer_gguf is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    else:
        _write_tokenizer(writer, tokenizer_gguf)
    for name, data, stored in _tensors(model, arch, qtype):
        writer.add_tensor(name, quantize(data, stored), raw_dtype=stored)
    return _finish(writer, path)


def dequantized_copy(model, qtype: GGMLQuantizationType):
    """A copy of ``model`` whose every matrix ``write_gguf(qtype=qtype)`` quantizes is replaced by
    its round trip through ``qtype``: the weights a GGUF reader should compute with."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if _stored_type(name, p, qtype) != F32:
                w = p.detach().float().numpy()
                p.copy_(torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape)))
    return out


def _stored_type(hf_name: str, tensor: torch.Tensor, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The converter keeps 1-D tensors and norms in F32 (prepare_tensors)."""
    return F32 if tensor.dim() <= 1 or hf_name.endswith("norm.weight") else qtype


def _rope(config) -> dict:
    """The global layers' rope parameters (``rope_parameters.get("full_attention", ...)``)."""
    params = config.rope_parameters
    return params.get("full_attention", params)


def _write_parameters(writer: GGUFWriter, config, arch: str) -> None:
    """The keys of the family's ``set_gguf_parameters``."""
    hparams = config.to_dict()
    rope = _rope(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch in ("gemma2", "gemma3"):
        _write_gemma(writer, config, arch, rope)
        return
    if arch == "phi3":
        _write_phi3(writer, config, rope, head_dim)
        return
    # TextModel.set_gguf_parameters
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope_type = rope.get("rope_type")
    if rope_type == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if (attn := rope.get("attention_factor")) is not None:
            writer.add_rope_scaling_yarn_attn_factor(attn)
        if (beta_fast := rope.get("beta_fast")) is not None:
            writer.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := rope.get("beta_slow")) is not None:
            writer.add_rope_scaling_yarn_beta_slow(beta_slow)
    elif rope_type == "longrope":
        writer.add_rope_scaling_type(RopeScalingType.LONGROPE)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if hparams.get("head_dim") is not None and arch != "granite":   # GraniteModel pops head_dim first
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
    if arch in _LLAMA_MODEL:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if arch == "granite":
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch == "mistral" and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)


def _write_gemma(writer: GGUFWriter, config, arch: str, rope: dict) -> None:
    """Gemma2Model / Gemma3Model.set_gguf_parameters (they do not call TextModel's)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        return
    writer.add_rope_freq_base(rope["rope_theta"])   # the global layers'
    if rope.get("rope_type") == "linear":           # global layers only
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])


def _write_phi3(writer: GGUFWriter, config, rope: dict, head_dim: int) -> None:
    """Phi3MiniModel.set_gguf_parameters, and the attention factor of generate_extra_tensors."""
    original = config.original_max_position_embeddings
    writer.add_context_length(config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
                                    // config.num_attention_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _extra_tensors(config, arch: str) -> list[tuple[str, np.ndarray]]:
    """generate_extra_tensors: Llama 3's per-frequency divisors, Phi-3's longrope factors."""
    rope = _rope(config)
    if rope.get("rope_type") == "llama3" and arch in _LLAMA_MODEL:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = rope["rope_theta"]
        freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        factors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                factors.append(1)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return [("rope_freqs.weight", torch.tensor(factors, dtype=torch.float32).numpy())]
    if rope.get("rope_type") == "longrope" and arch == "phi3":
        return [("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)),
                ("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))]
    return []


def _finish(writer: GGUFWriter, path) -> str:
    """Header, metadata and tensors to the file; its path as a string."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: each head's rows from "rotate half" order to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model, arch: str, qtype: GGMLQuantizationType):
    """(GGUF name, float32 array as the converter modifies it, stored type) for every tensor."""
    config = model.config
    names = get_tensor_name_map(_MODEL_ARCH[arch], config.num_hidden_layers)
    tied = config.tie_word_embeddings or arch == "gemma2"   # Gemma2Model skips lm_head
    out = [(name, data, F32) for name, data in _extra_tensors(config, arch)]
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no name for {hf_name} in {arch}"
        data = tensor.detach().float().numpy().copy()
        if arch in _PERMUTED and ".q_proj." in hf_name:
            data = _permute(data, config.num_attention_heads)
        if arch in _PERMUTED and ".k_proj." in hf_name:
            data = _permute(data, config.num_key_value_heads)
        if arch in _NORM_SHIFTED and hf_name.endswith("norm.weight"):
            data = data + 1
        out.append((gguf_name, data, _stored_type(hf_name, tensor, qtype)))
    return out


@functools.lru_cache(maxsize=2)
def _tokenizer_metadata(path: str) -> dict:
    """Every tokenizer.* key of a GGUF file, string arrays included."""
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


def _write_tokenizer(writer: GGUFWriter, path: str) -> None:
    for key, value in _tokenizer_metadata(path).items():
        if isinstance(value, bool):
            writer.add_key_value(key, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, GGUFValueType.UINT32)
        elif isinstance(value, str):
            writer.add_key_value(key, value, GGUFValueType.STRING)
        elif value and isinstance(value[0], str):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.STRING)
        elif value and isinstance(value[0], float):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
        else:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.INT32)


def write_lora_gguf(adapter_dir: str, config, path, arch: str | None = None,
                    qtype: GGMLQuantizationType = F32) -> str:
    """A PEFT adapter folder as llama.cpp's ``convert_lora_to_gguf.py`` writes it: ``general.type``
    "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha``, and per adapted matrix the gguf-py
    name + ``.weight.lora_a`` [r, in] and ``.lora_b`` [out, r], lora_b's rows permuted for q and k
    where the model's are (``LlamaModel.permute``)."""
    import json
    import os
    import re

    from safetensors.torch import load_file

    arch = arch or GGUF_ARCH[config.model_type]
    with open(os.path.join(adapter_dir, "adapter_config.json"), encoding="utf-8") as f:
        alpha = float(json.load(f)["lora_alpha"])
    names = get_tensor_name_map(_MODEL_ARCH[arch], config.num_hidden_layers)
    writer = GGUFWriter(str(path), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for key, tensor in sorted(load_file(os.path.join(adapter_dir, "adapter_model.safetensors")).items()):
        m = re.search(r"(model\.layers\.\d+\.\w+\.\w+)\.lora_([AB])\.weight$", key)
        data = tensor.float().numpy().copy()
        if m[2] == "B" and arch in _PERMUTED and ".q_proj" in m[1]:
            data = _permute(data, config.num_attention_heads)
        if m[2] == "B" and arch in _PERMUTED and ".k_proj" in m[1]:
            data = _permute(data, config.num_key_value_heads)
        name = names.get_name(m[1] + ".weight", try_suffixes=(".weight",)) + ".lora_" + m[2].lower()   # blk.N.attn_q.weight
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    return _finish(writer, path)
