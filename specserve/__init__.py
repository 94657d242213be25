"""specserve: an LLM inference engine with lossless speculative decoding."""
from specserve.config import EngineConfig, SpeculativeConfig
from specserve.entrypoints.llm import LLM
from specserve.outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from specserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "EngineConfig", "RequestOutput", "CompletionOutput", "SpecDecodeStats"]
__version__ = "0.1.0"
