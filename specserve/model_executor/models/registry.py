"""Architecture name -> model class. Every supported family runs on the one decoder
(``decoder.py``); anything else is a clear error (``decoder_spec.spec_for``)."""
from __future__ import annotations

from specserve.model_executor.models.decoder import DecoderForCausalLM
from specserve.model_executor.models.decoder_spec import SUPPORTED_ARCHITECTURES, architecture_of, spec_for

MODEL_REGISTRY = {arch: DecoderForCausalLM for arch in SUPPORTED_ARCHITECTURES}

__all__ = ["MODEL_REGISTRY", "architecture_of", "get_model_class"]


def get_model_class(config):
    spec_for(config)   # raises UnsupportedModelError naming the architecture or feature
    return MODEL_REGISTRY[architecture_of(config)]
