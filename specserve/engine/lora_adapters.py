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

import torch

from specserve.lora.peft_adapter import LoraAdapter, load_peft_adapter
from specserve.lora.request import LoRAMix, LoRARequest
from specserve.model_executor.gguf_lora import load_gguf_adapter

logger = logging.getLogger(__name__)

MIX_IDS_FROM = 1 << 40   # the ids of LoRAMix adapters (a LoRARequest's lora_int_id stays below)


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
        self._mix_ids: dict[tuple, int] = {}      # LoRAMix.key -> the id its adapter is loaded under
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
        if adapter_id >= MIX_IDS_FROM:
            raise ValueError(f"lora_int_id must be below {MIX_IDS_FROM} (ids above are the engine's, for LoRAMix)")
        adapter = read_adapter(lora_request.lora_path, self.hf_config, self.max_lora_rank)
        self._evict_idle(in_use)
        self.runner.add_lora(adapter_id, adapter.modules)
        self.loaded[adapter_id] = lora_request
        logger.info("LoRA adapter %r (id %d, rank %d, %d projections, %.1f MiB) loaded from %s",
                    lora_request.lora_name, adapter_id, adapter.rank, len(adapter.modules),
                    adapter.num_bytes() / 2**20, lora_request.lora_path)
        return adapter_id

    def acquire_mix(self, mix: LoRAMix, in_use: set[int]) -> int:
        """The id of ``mix``'s combined adapter (0: no part), built and loaded if it is not: for each
        projection, A = [A_1; A_2; ...] and B = [s_1 B_1, s_2 B_2, ...], so B A = sum s_i B_i A_i."""
        if not mix.parts:
            return 0
        if len(mix.parts) == 1 and mix.parts[0][1] == 1.0:
            return self.acquire(mix.parts[0][0], in_use)
        adapter_id = self._mix_ids.get(mix.key)
        if adapter_id in self.loaded:
            self.loaded.move_to_end(adapter_id)
            return adapter_id
        parts = [(read_adapter(r.lora_path, self.hf_config, self.max_lora_rank), scale) for r, scale in mix.parts]
        modules = {}
        for key in sorted({k for adapter, _ in parts for k in adapter.modules}):
            pairs = [(adapter.modules[key][0], scale * adapter.modules[key][1]) for adapter, scale in parts
                     if key in adapter.modules]
            modules[key] = (torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs], dim=1))
        if adapter_id is None:
            adapter_id = self._mix_ids[mix.key] = MIX_IDS_FROM + len(self._mix_ids)
        self._evict_idle(in_use)
        self.runner.add_lora(adapter_id, modules)
        self.loaded[adapter_id] = LoRARequest(mix.lora_name, adapter_id, mix.lora_name)
        logger.info("LoRA mix %s loaded (id %d)", mix.lora_name, adapter_id)
        return adapter_id

    def _evict_idle(self, in_use: set[int]) -> None:
        idle = [i for i in self.loaded if i not in in_use]
        while idle and len(self.loaded) >= self.max_cpu_loras:
            self.remove(idle.pop(0))

    def remove(self, adapter_id: int) -> bool:
        """Drop an adapter (the caller makes sure no request uses it); False if it was not loaded."""
        if self.loaded.pop(adapter_id, None) is None:
            return False
        self.runner.remove_lora(adapter_id)
        return True
