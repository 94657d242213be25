"""A GGUF file's Hugging Face config, rebuilt from the metadata llama.cpp's converter writes.

A GGUF file has no config.json: ``convert_hf_to_gguf.py`` (ggml-org/llama.cpp, the
``conversion/`` package in current versions) writes the model's hyperparameters as
``{arch}.*`` metadata keys, some as small tensors, and leaves others out because
llama.cpp hardcodes them per architecture. This module inverts that, family by family,
into the config the Hugging Face model had, so the one decoder computes what llama.cpp
computes on the file.

Why not transformers' own GGUF conversion (``AutoConfig.from_pretrained(gguf_file=...)``):

- it maps a handful of keys per architecture and drops the rest: rope scaling
  (``rope.scaling.*``), Llama 3's ``rope_freqs`` and Phi-3's ``rope_factors_*`` tensors,
  Qwen3's ``attention.key_length``, Phi-3's partial rotary and sliding window, Gemma 2's
  soft-caps, Gemma's attention scale, Mistral's window; so those files loaded with wrong
  configs;
- it builds no config at all for granite, olmo2 and smollm3 files;
- it parses the whole file with ``gguf.GGUFReader`` first (~5 s for a 49k-token
  vocabulary, most of a load), where ``gguf_file``'s header walk takes ~10 ms.

Every field transformers' conversion sets is set here the same way (tested), then the
corrections below (``llama.cpp key -> config field``):

==========  =====================================================================================
all         rope.freq_base -> rope_theta (llama.cpp's default 10000 when absent);
            rope.scaling.type linear|yarn -> rope_type, rope.scaling.factor -> factor,
            rope.scaling.original_context_length -> original_max_position_embeddings,
            rope.scaling.yarn_attn_factor (or attn_factor) / yarn_beta_fast / yarn_beta_slow
            -> attention_factor / beta_fast / beta_slow;
            rope.dimension_count < head_dim -> partial_rotary_factor;
            attention.key_length -> head_dim (else hidden / heads, as llama.cpp);
            tensor rope_freqs (Llama 3.x) -> see below;
            blk.0.attn_q.bias / blk.0.ffn_up.bias -> attention_bias / mlp_bias
mistral     attention.sliding_window -> sliding_window
gemma2      attn_logit_softcapping, final_logit_softcapping, attention.sliding_window
            (llama.cpp's defaults 50, 30 and 4096 for files converted before those keys), every
            other layer sliding (llama.cpp's fixed pattern)
gemma3      attention.sliding_window (0: none), five sliding layers then one global
            (llama.cpp's fixed pattern), sliding layers' rope base 10000 (llama.cpp's fixed
            value), rope.freq_base and rope.scaling.* for the global layers only,
            final_logit_softcapping
gemma2/3    query_pre_attn_scalar: hidden / heads for the 27B models (46 / 62 layers), else
            head_dim: llama.cpp's rule, the file has no key for it
phi3        rope.dimension_count -> partial_rotary_factor, attention.sliding_window (0: none),
            rope.scaling.original_context_length (else the context length, as llama.cpp),
            tensors rope_factors_long/short ->
            longrope's long_factor/short_factor, rope.scaling.attn_factor -> attention_factor
granite     attention.scale, embedding_scale, residual_scale, logit_scale -> the multipliers
            (absent: llama.cpp's neutral values, head_dim^-1/2 for attention)
olmo2       as ``all`` (a sliding-window pattern marks an OLMo 3 file: refused)
smollm3     every fourth layer without rotary (llama.cpp's fixed n_no_rope_layer_step = 4)
==========  =====================================================================================

Llama 3.x's rope scaling: llama.cpp's converter stores it as a tensor ``rope_freqs``, one
divisor per rotary frequency (1 for high frequencies, ``factor`` for low ones, a blend
between), and computes ``inv_freq / rope_freqs``. The llama3 parameters cannot be recovered
from the divisors exactly (only ratios of ``original_max_position_embeddings`` and the two
frequency factors show in them), but transformers' ``longrope`` with
``short_factor == long_factor == rope_freqs`` and ``attention_factor = 1`` computes exactly
``inv_freq / factors`` (its long factors apply only past ``original_max_position_embeddings``,
set to the context length, and are the same anyway). So the config stays one that both
transformers and specserve compute as llama.cpp does, from the config alone (tensor-parallel
workers, drafts and the transformers peer build their rotary tables from the config), with
the factors kept in float32 as the file has them.

Architectures llama.cpp writes that none of specserve's families are, and what a config
cannot hold (an OLMo 3 file, rope scalings llama.cpp does not write), raise
``UnsupportedModelError`` naming it; a file without a key the converter always writes raises
``InvalidModelFileError``.
"""
from __future__ import annotations

import os

import numpy as np
import transformers
from transformers import AutoConfig

from specserve.model_executor.gguf_file import GGUFTable, InvalidModelFileError, read_gguf_table
from specserve.model_executor.models.decoder_spec import SUPPORTED_ARCHITECTURES, UnsupportedModelError

# GGUF general.architecture -> (Hugging Face model_type, architecture). llama.cpp converts
# Mistral (and Ministral 8B's MistralForCausalLM) checkpoints as "llama"; "mistral" files come
# from other writers, whose keys transformers reads the same way.
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
}

# llama.cpp's values where a key is absent (llama_hparams defaults, llama-model.cpp).
_DEFAULT_ROPE_THETA = 10000.0
_GEMMA2_SOFTCAPS = (50.0, 30.0)   # attention logits, final logits (files converted before the keys)
_GEMMA2_WINDOW = 4096
_GEMMA3_SLIDING_ROPE_THETA = 10000.0
_GEMMA3_PATTERN = 6               # five sliding layers, then a global one
_SMOLLM3_NO_ROPE_STEP = 4         # layer i has no rotary when (i + 1) % 4 == 0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}   # the models llama.cpp scales by hidden / heads


class _Keys:
    """The file's metadata under its architecture's prefix: ``keys["rope.freq_base"]``."""

    def __init__(self, table: GGUFTable, path: str):
        self.table, self.path, self.arch, self.md = table, path, table.architecture, table.metadata

    def get(self, name: str, default=None):
        return self.md.get(f"{self.arch}.{name}", default)

    def __getitem__(self, name: str):
        key = f"{self.arch}.{name}"
        if key not in self.md:
            raise InvalidModelFileError(f"{self.path}: not a usable GGUF file: it has no {key!r}, which "
                                        f"llama.cpp's converter writes for {self.arch!r} models")
        return self.md[key]


def config_from_gguf(path: str) -> transformers.PretrainedConfig:
    """The Hugging Face config of the model in the GGUF file ``path`` (see the module docstring);
    ``UnsupportedModelError`` for an architecture specserve does not run."""
    table = read_gguf_table(path)
    arch = table.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not one specserve runs; it reads GGUF files of the "
            f"architectures {', '.join(GGUF_ARCHITECTURES)} and Hugging Face folders of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    keys = _Keys(table, path)
    model_type, architecture = GGUF_ARCHITECTURES[arch]
    fields = _common_fields(keys)
    fields.update(_FAMILY_FIELDS.get(arch, _no_fields)(keys, fields))
    fields.update(model_type=model_type, architectures=[architecture])
    return AutoConfig.for_model(**fields)


def _common_fields(keys: _Keys) -> dict:
    """What every family's file states the same way (transformers' GGUF_CONFIG_MAPPING and the
    defaults of its conversion, plus rope scaling, head_dim and biases)."""
    table, md = keys.table, keys.md
    names = {t.name for t in table.tensors}
    embedding = table.tensor("token_embd.weight")
    hidden, heads = keys["embedding_length"], keys["attention.head_count"]
    # llama.cpp: key_length, else hidden / heads; its llama arch requires rope.dimension_count to
    # equal it, which transformers reads as head_dim for llama and mistral files
    head_dim = keys.get("attention.key_length") or (
        keys.get("rope.dimension_count") if keys.arch in ("llama", "mistral") else None) or hidden // heads
    fields = dict(
        max_position_embeddings=keys["context_length"],
        num_hidden_layers=keys["block_count"],
        intermediate_size=keys["feed_forward_length"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=keys.get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=keys["attention.layer_norm_rms_epsilon"],
        # the embedding's rows are the vocabulary the weights have ({arch}.vocab_size is optional)
        vocab_size=keys.get("vocab_size") or (embedding.shape[0] if embedding is not None else None),
        # llama.cpp's converter writes the output projection only when it is not the embedding
        tie_word_embeddings="output.weight" not in names,
        rope_parameters=_rope_parameters(keys, head_dim),
    )
    # biases the config class would otherwise say are absent (mlp_bias is then refused by spec_for)
    fields.update({field: True for field, tensor in (("attention_bias", "blk.0.attn_q.bias"),
                                                      ("mlp_bias", "blk.0.ffn_up.bias")) if tensor in names})
    for name, field in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id"),
                        ("unknown", "unk_token_id")):
        if (token := md.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            fields[field] = token
    return fields


def _rope_parameters(keys: _Keys, head_dim: int) -> dict:
    """rope_parameters from rope.freq_base, rope.scaling.*, rope.dimension_count and the
    rope_freqs tensor (the global layers' for Gemma 3, which adds its sliding layers')."""
    params: dict = {"rope_type": "default", "rope_theta": float(keys.get("rope.freq_base", _DEFAULT_ROPE_THETA))}
    rotary_dims = keys.get("rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        params["partial_rotary_factor"] = rotary_dims / head_dim
    scaling = keys.get("rope.scaling.type", "none")
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(keys["rope.scaling.factor"]))
    elif scaling == "yarn":
        params.update(rope_type="yarn", factor=float(keys["rope.scaling.factor"]),
                      original_max_position_embeddings=int(keys["rope.scaling.original_context_length"]))
        # the converter writes these only where the Hugging Face config had them; OLMo 2's writes
        # its attention_factor as rope.scaling.attn_factor
        attention = keys.get("rope.scaling.yarn_attn_factor", keys.get("rope.scaling.attn_factor"))
        for field, value in (("attention_factor", attention), ("beta_fast", keys.get("rope.scaling.yarn_beta_fast")),
                             ("beta_slow", keys.get("rope.scaling.yarn_beta_slow"))):
            if value is not None:
                params[field] = float(value)
    elif scaling not in ("none", "longrope"):   # longrope: Phi-3's factors, read by _phi3
        raise UnsupportedModelError(f"{keys.path}: rope scaling type {scaling!r} ({keys.arch}.rope.scaling.type) "
                                    "is not one llama.cpp writes (none, linear, yarn, longrope)")
    if keys.table.tensor("rope_freqs.weight") is not None:
        if params["rope_type"] != "default":
            raise UnsupportedModelError(f"{keys.path}: rope_freqs together with {params['rope_type']} rope scaling "
                                        "is not supported")
        factors = _f32_tensor(keys, "rope_freqs.weight")
        context = keys["context_length"]
        # inv_freq / factors, as llama.cpp computes it (module docstring)
        params.update(rope_type="longrope", short_factor=factors, long_factor=factors, factor=1.0,
                      attention_factor=1.0, original_max_position_embeddings=context)
    return params


def _f32_tensor(keys: _Keys, name: str) -> list[float]:
    """A small float32 tensor of the file (rotary factors) as a list of floats."""
    from gguf import GGMLQuantizationType

    t = keys.table.tensor(name)
    if t is None or t.ggml_type != GGMLQuantizationType.F32:
        found = "missing" if t is None else GGMLQuantizationType(t.ggml_type).name
        raise InvalidModelFileError(f"{keys.path}: not a usable GGUF file: tensor {name!r} is {found}, "
                                    "llama.cpp writes it as F32")
    with open(keys.path, "rb") as fh:
        fh.seek(t.offset)
        return np.frombuffer(fh.read(t.nbytes), dtype="<f4").astype(np.float64).tolist()


def _no_fields(keys: _Keys, fields: dict) -> dict:
    return {}


def _sliding_window(keys: _Keys) -> int | None:
    """attention.sliding_window; 0 or absent: none."""
    return keys.get("attention.sliding_window") or None


def _mistral(keys: _Keys, fields: dict) -> dict:
    return dict(sliding_window=_sliding_window(keys))


def _gemma_attention_scalar(keys: _Keys, fields: dict) -> int:
    """Gemma's query_pre_attn_scalar as llama.cpp chooses it (the file has no key for it):
    hidden / heads for the 27B models, else head_dim (what Gemma 2 and 3 of every other size use)."""
    if fields["num_hidden_layers"] == _GEMMA_27B_LAYERS[keys.arch]:
        return fields["hidden_size"] // fields["num_attention_heads"]
    return fields["head_dim"]


def _gemma2(keys: _Keys, fields: dict) -> dict:
    n = fields["num_hidden_layers"]
    return dict(
        attn_logit_softcapping=float(keys.get("attn_logit_softcapping", _GEMMA2_SOFTCAPS[0])),
        final_logit_softcapping=float(keys.get("final_logit_softcapping", _GEMMA2_SOFTCAPS[1])),
        sliding_window=keys.get("attention.sliding_window", _GEMMA2_WINDOW),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        query_pre_attn_scalar=_gemma_attention_scalar(keys, fields),
    )


def _gemma3(keys: _Keys, fields: dict) -> dict:
    n, window = fields["num_hidden_layers"], _sliding_window(keys)
    if window is None:
        layer_types = ["full_attention"] * n
    else:
        layer_types = ["full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention" for i in range(n)]
    sliding_rope = {"rope_type": "default", "rope_theta": _GEMMA3_SLIDING_ROPE_THETA}
    final_cap = keys.get("final_logit_softcapping")
    return dict(
        sliding_window=window,
        layer_types=layer_types,
        rope_parameters={"sliding_attention": sliding_rope, "full_attention": fields["rope_parameters"]},
        query_pre_attn_scalar=_gemma_attention_scalar(keys, fields),
        final_logit_softcapping=float(final_cap) if final_cap else None,
        attn_logit_softcapping=None,
    )


def _phi3(keys: _Keys, fields: dict) -> dict:
    # llama.cpp: the training context where the file does not say
    original = int(keys.get("rope.scaling.original_context_length", fields["max_position_embeddings"]))
    rope = dict(fields["rope_parameters"])
    rope.setdefault("partial_rotary_factor", 1.0)
    if keys.table.tensor("rope_factors_long.weight") is not None:
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    long_factor=_f32_tensor(keys, "rope_factors_long.weight"),
                    short_factor=_f32_tensor(keys, "rope_factors_short.weight"))
        if (attention := keys.get("rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = float(attention)
    return dict(rope_parameters=rope, original_max_position_embeddings=original,
                sliding_window=_sliding_window(keys))


def _granite(keys: _Keys, fields: dict) -> dict:
    # the converter writes each only when set; llama.cpp's graph then leaves that scale out
    return dict(
        attention_multiplier=float(keys.get("attention.scale") or fields["head_dim"] ** -0.5),
        embedding_multiplier=float(keys.get("embedding_scale") or 1.0),
        residual_multiplier=float(keys.get("residual_scale") or 1.0),
        logits_scaling=float(keys.get("logit_scale") or 1.0),
    )


def _olmo2(keys: _Keys, fields: dict) -> dict:
    pattern = keys.get("attention.sliding_window_pattern")
    if pattern is not None and any(pattern):
        raise UnsupportedModelError(
            f"{keys.path}: an olmo2 GGUF file with sliding-window layers (olmo2.attention.sliding_window_pattern) "
            "is OLMo 3, which specserve does not run; OLMo 2 files and folders work")
    return {}


def _smollm3(keys: _Keys, fields: dict) -> dict:
    n = fields["num_hidden_layers"]
    return dict(no_rope_layers=[int((i + 1) % _SMOLLM3_NO_ROPE_STEP != 0) for i in range(n)],
                use_sliding_window=False)


_FAMILY_FIELDS = {"mistral": _mistral, "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3,
                  "granite": _granite, "olmo2": _olmo2, "smollm3": _smollm3}


def tokenizer_from_gguf(path: str, model_type: str):
    """The tokenizer the GGUF file describes (its ``tokenizer.*`` metadata), of the class
    ``AutoTokenizer`` picks for ``model_type``.

    transformers builds it from ``tokenizer.ggml.model`` (gpt2, llama, ...) whatever the
    architecture (only sentencepiece files of Gemma and Phi-3 get their own builders), so
    granite, olmo2 and smollm3 files work too. ``AutoTokenizer.from_pretrained(gguf_file=...)``
    would first convert the file's config with ``GGUFReader`` (~4 s, and an error for the
    architectures it has no config for), only to read ``model_type`` from it."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = (tokenizer_class_from_name(name) if name else None) or TokenizersBackend
    folder, filename = os.path.split(os.path.abspath(path))
    return cls.from_pretrained(folder, gguf_file=filename)
