"""Architecture name -> model class. Anything else is a clear error."""
from __future__ import annotations

from specserve.model_executor.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architecture_of(config) -> str:
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    return _MODEL_TYPE_TO_ARCH.get(getattr(config, "model_type", ""), getattr(config, "model_type", "unknown"))


def get_model_class(config):
    arch = architecture_of(config)
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch}; specserve supports {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[arch]
