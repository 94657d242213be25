"""LoRARequest: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and folder, as in vLLM.

    ``lora_int_id`` is the adapter's identity in the engine (positive; two requests with the same id
    share one loaded copy and their cached prefixes); ``lora_path`` is a PEFT adapter folder
    (adapter_config.json and adapter_model.safetensors, or adapter_model.bin) or a llama.cpp LoRA
    file (.gguf, as its convert_lora_to_gguf.py writes).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(f"lora_path must be a folder, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class LoRAMix:
    """Several adapters at once, each at a scale, their products added (llama.cpp's per-request
    ``lora`` list): one adapter of their ranks concatenated (A stacked, B side by side, each scaled),
    loaded under an id of its own. Parts at scale 0 are left out; no part left: the base model."""

    parts: tuple[tuple[LoRARequest, float], ...]

    def __post_init__(self) -> None:
        for part in self.parts:
            if not (isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], LoRARequest)
                    and isinstance(part[1], (int, float)) and not isinstance(part[1], bool)):
                raise ValueError(f"a LoRAMix part is (LoRARequest, scale), got {part!r}")
            if part[1] != part[1] or abs(part[1]) == float("inf"):
                raise ValueError(f"a LoRA scale must be a finite number, got {part[1]!r}")
        object.__setattr__(self, "parts", tuple((r, float(s)) for r, s in self.parts if s != 0))

    @property
    def key(self) -> tuple[tuple[str, float], ...]:
        return tuple((r.lora_path, s) for r, s in self.parts)

    @property
    def lora_name(self) -> str:
        """What logs and the metrics call it: "0.5 x caps + 1 x poet"."""
        return " + ".join(f"{s:g} x {r.lora_name}" for r, s in self.parts)
