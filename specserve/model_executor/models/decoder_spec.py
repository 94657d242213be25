"""What sets one decoder family apart from another, read from its Hugging Face config.

specserve runs every supported family with ONE decoder (``models/decoder.py``). The
families differ in a handful of declared ways, collected here as a ``DecoderSpec``:

===============  ==========================================================================
norms            ``pre`` (Llama: a norm before attention and before the MLP), ``sandwich``
                 (Gemma 2/3: also a norm on each branch's output before the residual add),
                 ``post`` (OLMo 2: only the branch-output norms)
norm_offset      1.0 where the norm multiplies by ``(1 + w)`` (Gemma), else 0.0
qk_norm          None, ``head`` (RMSNorm over each head's q and k: Qwen3, Gemma 3) or
                 ``all`` (over the whole q and k projections: OLMo 2)
activation       ``silu`` or ``gelu_tanh`` (Gemma) of the gated MLP
qkv_bias         q/k/v projections with a bias (Qwen2)
scales           embeddings times ``embed_scale`` (Gemma: sqrt(hidden); Granite's
                 embedding_multiplier), each branch times ``residual_scale`` (Granite),
                 attention scores times ``attn_scale`` (head_dim^-1/2, Gemma's
                 query_pre_attn_scalar^-1/2, Granite's attention_multiplier), logits divided
                 by ``logits_divisor`` (Granite)
soft-caps        ``attn_softcap`` on attention scores and ``final_softcap`` on logits (Gemma 2)
layers           per layer: its sliding window (None = global attention) and which rotary
                 table it uses (None = no rotary: SmolLM3's NoPE layers); Gemma 3's local
                 and global layers use rotary tables with different bases
===============  ==========================================================================

Rotary tables themselves come from transformers' own RoPE functions (``layers/rotary.py``),
so every rope type it defines (``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope``,
``llama3``) and ``partial_rotary_factor`` are computed as the reference computes them.

Anything this spec cannot express is refused by ``spec_for`` with the reason, before any
weight is read; nothing loads and computes something else silently.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from specserve.model_executor.layers.rotary import rope_parameters_by_layer_type

# Hugging Face architecture -> family. Each family's differences are set in ``spec_for``.
FAMILY_OF_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "SmolLM3ForCausalLM": "smollm3",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILY_OF_ARCHITECTURE)
_ARCHITECTURE_OF_MODEL_TYPE = {family: arch for arch, family in FAMILY_OF_ARCHITECTURE.items()}
_ARCHITECTURE_OF_MODEL_TYPE["gemma3"] = "Gemma3ForCausalLM"   # GGUF files name Gemma 3's text decoder so

# Rope types transformers computes that a fixed table per position can hold (``layers/rotary.py``).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


class UnsupportedModelError(ValueError):
    """The model's architecture, or one feature of its config, is not one specserve computes."""


@dataclass(frozen=True)
class LayerSpec:
    sliding_window: int | None   # keys further back than this are not attended; None = all
    rope: str | None             # which rotary table (a key of DecoderSpec.rope_layer_types); None = no rotary


@dataclass(frozen=True)
class DecoderSpec:
    family: str
    norms: str = "pre"                 # "pre" | "sandwich" | "post"
    norm_offset: float = 0.0
    qk_norm: str | None = None         # None | "head" | "all"
    activation: str = "silu"           # "silu" | "gelu_tanh"
    qkv_bias: bool = False
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    attn_scale: float = 1.0
    logits_divisor: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layers: tuple[LayerSpec, ...] = ()

    @property
    def rope_layer_types(self) -> tuple[str, ...]:
        """The distinct rotary tables the layers use (keys of ``LayerSpec.rope``)."""
        return tuple(sorted({layer.rope for layer in self.layers if layer.rope is not None}))


def architecture_of(config) -> str:
    """The config's architecture name (GGUF-derived configs may only have a model_type)."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", "unknown")
    return _ARCHITECTURE_OF_MODEL_TYPE.get(model_type, model_type)


def _unsupported(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{what}; specserve supports the architectures {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"with rope types {', '.join(SUPPORTED_ROPE_TYPES)} (docs/models.md)")


def _check_rope(config) -> None:
    for layer_type, params in rope_parameters_by_layer_type(config).items():
        rope_type = (params or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            where = f" (layer type {layer_type})" if layer_type else ""
            raise _unsupported(f"unsupported rope type {rope_type!r}{where}")


def _layers(config, family: str) -> tuple[LayerSpec, ...]:
    """Each layer's window and rotary table, as the family's transformers model picks them."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    by_type = rope_parameters_by_layer_type(config)
    if layer_types is None or family in ("mistral", "phi3"):
        # every layer windowed where the config sets a window (Mistral, Phi-3), none elsewhere
        windows = [window if family in ("mistral", "phi3") else None] * n
        layer_types = ["full_attention"] * n
    else:
        uses_window = getattr(config, "use_sliding_window", True) if family == "smollm3" else True
        windows = [window if t == "sliding_attention" and uses_window else None for t in layer_types]
    ropes: list[str | None] = [t if t in by_type else "" for t in layer_types]
    if family == "smollm3":   # no_rope_layers[i] == 1 means layer i uses rotary
        ropes = [r if use else None for r, use in zip(ropes, config.no_rope_layers)]
    return tuple(LayerSpec(int(w) if w else None, r) for w, r in zip(windows, ropes))


def spec_for(config) -> DecoderSpec:
    """The DecoderSpec of a supported config; ``UnsupportedModelError`` naming what is not."""
    arch = architecture_of(config)
    family = FAMILY_OF_ARCHITECTURE.get(arch)
    if family is None:
        raise _unsupported(f"unsupported architecture {arch}")
    _check_rope(config)
    if getattr(config, "mlp_bias", False):
        raise _unsupported(f"{arch} with mlp_bias=True is not supported")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
    if activation is None:
        raise _unsupported(f"{arch} with activation {act!r} is not supported (silu, gelu_pytorch_tanh are)")
    if getattr(config, "use_bidirectional_attention", False):
        raise _unsupported(f"{arch} with bidirectional attention (an embedding model) is not a causal LM")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    common = dict(family=family, activation=activation, layers=_layers(config, family),
                  attn_scale=head_dim ** -0.5,
                  qkv_bias=bool(getattr(config, "attention_bias", False)) or family == "qwen2")
    if family in ("gemma2", "gemma3_text"):
        return DecoderSpec(**{**common, "attn_scale": config.query_pre_attn_scalar ** -0.5},
                           norms="sandwich", norm_offset=1.0, qk_norm="head" if family == "gemma3_text" else None,
                           embed_scale=math.sqrt(config.hidden_size),
                           attn_softcap=getattr(config, "attn_logit_softcapping", None),
                           final_softcap=getattr(config, "final_logit_softcapping", None))
    if family == "qwen3":
        return DecoderSpec(**common, qk_norm="head")
    if family == "olmo2":
        return DecoderSpec(**common, norms="post", qk_norm="all")
    if family == "granite":
        return DecoderSpec(**{**common, "attn_scale": config.attention_multiplier},
                           embed_scale=config.embedding_multiplier, residual_scale=config.residual_multiplier,
                           logits_divisor=config.logits_scaling)
    return DecoderSpec(**common)


def eagle_layer_spec(head_dim: int) -> DecoderSpec:
    """An EAGLE head's one layer: the Llama layer with one rotary table (eagle.py)."""
    return DecoderSpec(family="llama", attn_scale=head_dim ** -0.5, layers=(LayerSpec(None, ""),))
