"""The LoRA adapters loaded into the target, by id (vLLM's ``enable_lora``).

An adapter is read and checked when a request first names it (a PEFT folder: ``lora.peft_adapter``;
a llama.cpp LoRA file: ``model_executor.gguf_lora``; a bad one is that request's ValueError, before
any work), then added to every adapted projection
of the target (``ModelRunner.add_lora``; on every rank under tensor parallelism). It stays loaded
while requests use it; beyond ``max_cpu_loras`` loaded adapters, the least recently used one that
no request uses is dropped. How many adapters run in one step is the scheduler's ``max_loras``.

Drafts (a draft model, an EAGLE head) run without the adapter: they only propose, and the
target, adapter included, verifies, so the output is the adapted model's exactly; acceptance is
what the base draft guesses of the adapted target.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict

from specserve.lora.peft_adapter import LoraAdapter, load_peft_adapter
from specserve.lora.request import LoRARequest
from specserve.model_executor.gguf_lora import load_gguf_adapter

logger = logging.getLogger(__name__)


def read_adapter(path: str, hf_config, max_lora_rank: int) -> LoraAdapter:
    """A PEFT adapter folder, or llama.cpp's LoRA file (.gguf), checked against the model."""
    if path.endswith(".gguf") and os.path.isfile(path):
        return load_gguf_adapter(path, hf_config, max_lora_rank)
    return load_peft_adapter(path, hf_config, max_lora_rank)


class LoraAdapters:
    def __init__(self, runner, hf_config, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.runner = runner
        self.hf_config = hf_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()   # least recently used first
        runner.enable_lora()

    def acquire(self, lora_request: LoRARequest, in_use: set[int]) -> int:
        """The adapter's id, loaded if it is not (``in_use``: ids unfinished requests hold, never
        dropped); raises ValueError for an adapter that cannot run."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        adapter_id = lora_request.lora_int_id
        known = self.loaded.get(adapter_id)
        if known is not None:
            if known.lora_path != lora_request.lora_path:
                raise ValueError(f"LoRA id {adapter_id} is already loaded from {known.lora_path!r}, not "
                                 f"{lora_request.lora_path!r}: give each adapter its own lora_int_id")
            self.loaded.move_to_end(adapter_id)
            return adapter_id
        adapter = read_adapter(lora_request.lora_path, self.hf_config, self.max_lora_rank)
        idle = [i for i in self.loaded if i not in in_use]
        while idle and len(self.loaded) >= self.max_cpu_loras:
            self.remove(idle.pop(0))
        self.runner.add_lora(adapter_id, adapter.modules)
        self.loaded[adapter_id] = lora_request
        logger.info("LoRA adapter %r (id %d, rank %d, %d projections, %.1f MiB) loaded from %s",
                    lora_request.lora_name, adapter_id, adapter.rank, len(adapter.modules),
                    adapter.num_bytes() / 2**20, lora_request.lora_path)
        return adapter_id

    def remove(self, adapter_id: int) -> bool:
        """Drop an adapter (the caller makes sure no request uses it); False if it was not loaded."""
        if self.loaded.pop(adapter_id, None) is None:
            return False
        self.runner.remove_lora(adapter_id)
        return True
