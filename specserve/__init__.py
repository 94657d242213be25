"""specserve: an LLM inference engine with lossless speculative decoding."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.beam_search_params import BeamSearchOutput, BeamSearchParams
    from specserve.config import EngineConfig, SpeculativeConfig
    from specserve.entrypoints.llm import LLM
    from specserve.lora.request import LoRAMix, LoRARequest
    from specserve.outputs import CompletionOutput, RequestOutput, SpecDecodeStats
    from specserve.sampling_params import SamplingParams, StructuredOutput

# Imported on first use (PEP 562), so a process that needs only a submodule (a
# tensor-parallel worker: torch and the model code) skips transformers and the loader.
_EXPORTS = {
    "BeamSearchParams": "specserve.beam_search_params",
    "BeamSearchOutput": "specserve.beam_search_params",
    "EngineConfig": "specserve.config",
    "SpeculativeConfig": "specserve.config",
    "LLM": "specserve.entrypoints.llm",
    "LoRARequest": "specserve.lora.request",
    "LoRAMix": "specserve.lora.request",
    "CompletionOutput": "specserve.outputs",
    "RequestOutput": "specserve.outputs",
    "SpecDecodeStats": "specserve.outputs",
    "SamplingParams": "specserve.sampling_params",
    "StructuredOutput": "specserve.sampling_params",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")

__all__ = ["LLM", "LoRARequest", "LoRAMix", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "StructuredOutput", "SpeculativeConfig", "EngineConfig", "RequestOutput", "CompletionOutput", "SpecDecodeStats"]
__version__ = "0.1.0"
