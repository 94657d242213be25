"""The server's LoRA adapters by name (vLLM's ``--lora-modules`` and its runtime endpoints).

A request names an adapter in ``model``; the answer carries that name back. ``GET /v1/models``
lists each adapter with the base model as its parent. With runtime updating allowed
(``SPECSERVE_ALLOW_RUNTIME_LORA_UPDATING=1``, or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``),
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and drop adapters by name.
"""
from __future__ import annotations

import itertools
import os

from fastapi.responses import PlainTextResponse

from specserve.entrypoints.openai.limits import APIError
from specserve.lora.request import LoRARequest

RUNTIME_UPDATING_VARIABLES = ("SPECSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes") for v in RUNTIME_UPDATING_VARIABLES)


class LoraModules:
    """Adapters by the name requests use; ids are given in order (1, 2, ...) and never reused."""

    def __init__(self, base_names: list[str]) -> None:
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def request_for(self, name: str, path: str) -> LoRARequest:
        if name in self.base_names or name in self.by_name:
            raise APIError(400, f"the LoRA adapter {name!r} has already been loaded (or names the base model)",
                           param="lora_name", code="invalid_value")
        return LoRARequest(name, next(self._ids), path)

    def add(self, request: LoRARequest) -> None:
        self.by_name[request.lora_name] = request

    def pop(self, name: str) -> LoRARequest:
        if name not in self.by_name:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name", code="model_not_found")
        return self.by_name.pop(name)

    def get(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model is not None else None


def add_static_modules(serving, modules: list[tuple[str, str]]) -> None:
    """``--lora-modules``: each adapter loaded and checked now (a bad one stops the start, naming it)."""
    for name, path in modules:
        request = serving.loras.request_for(name, path)
        try:
            serving.engine.add_lora(request)
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}") from None
        serving.loras.add(request)


async def load_adapter(serving, req, raw) -> PlainTextResponse:
    """POST /v1/load_lora_adapter: the adapter loaded (on the engine thread, between steps) and named."""
    request = serving.loras.request_for(req.lora_name, req.lora_path)
    try:
        await serving.async_engine.run_on_engine(serving.engine.add_lora, request)
    except ValueError as e:
        raise APIError(400, str(e), param="lora_path", code="invalid_value") from None
    serving.loras.add(request)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_adapter(serving, req, raw) -> PlainTextResponse:
    """POST /v1/unload_lora_adapter: the name forgotten, the adapter dropped (a 400 while requests use it)."""
    request = serving.loras.pop(req.lora_name)
    try:
        await serving.async_engine.run_on_engine(serving.engine.remove_lora, request.lora_int_id)
    except ValueError as e:
        serving.loras.add(request)
        raise APIError(400, str(e), param="lora_name", code="invalid_value") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
