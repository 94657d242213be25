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
from specserve.lora.request import LoRAMix, LoRARequest

RUNTIME_UPDATING_VARIABLES = ("SPECSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes") for v in RUNTIME_UPDATING_VARIABLES)


class LoraModules:
    """Adapters by the name requests use; ids are given in order (1, 2, ...) and never reused."""

    def __init__(self, base_names: list[str]) -> None:
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self.ids = itertools.count(1)        # the adapters' lora_int_ids (llama-server's --lora files' too)

    def request_for(self, name: str, path: str) -> LoRARequest:
        if name in self.base_names or name in self.by_name:
            raise APIError(400, f"the LoRA adapter {name!r} has already been loaded (or names the base model)",
                           param="lora_name", code="invalid_value")
        return LoRARequest(name, next(self.ids), path)

    def add(self, request: LoRARequest) -> None:
        self.by_name[request.lora_name] = request

    def pop(self, name: str) -> LoRARequest:
        if name not in self.by_name:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name", code="model_not_found")
        return self.by_name.pop(name)

    def get(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model is not None else None


def add_static_modules(serving, modules: list[tuple[str, str]], llama_loras: list[tuple[str, float]]) -> None:
    """``--lora-modules`` (by name) and llama-server's ``--lora`` files (by number, at a scale): each
    adapter loaded and checked now (a bad one stops the start, naming it)."""
    def loaded(request: LoRARequest, flag: str) -> LoRARequest:
        try:
            serving.engine.add_lora(request)
        except ValueError as e:
            raise ValueError(f"{flag} {request.lora_path}: {e}") from None
        return request

    for name, path in modules:
        serving.loras.add(loaded(serving.loras.request_for(name, path), f"--lora-modules {name}="))
    ids = serving.loras.ids
    serving.llama_loras = LlamaLoras([(loaded(LoRARequest(os.path.basename(path) or path, next(ids), path), "--lora"),
                                       scale) for path, scale in llama_loras])


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


MAX_SCALE = 1000.0   # a request's LoRA scale at most (beyond it float32 products overflow to nonsense)


class LlamaLoras:
    """llama-server's adapters (``serve --lora FILE``, ``--lora-scaled FILE SCALE``): numbered from 0,
    each with a global scale (1, the given one, or 0 with ``--lora-init-without-apply``) that applies
    to every request naming no adapter in ``model``; a request's ``lora`` list sets its own scales
    (adapters it leaves out: 0); GET and POST /lora-adapters read and set the global ones."""

    def __init__(self, adapters: list[tuple[LoRARequest, float]]) -> None:
        self.adapters = [request for request, _ in adapters]
        self.scales = [scale for _, scale in adapters]

    def mix(self, scales: list[float] | None = None) -> LoRAMix | None:
        """The adapters at ``scales`` (default: the global ones) as one LoRAMix; None without adapters."""
        if not self.adapters:
            return None
        return LoRAMix(tuple(zip(self.adapters, self.scales if scales is None else scales)))

    def scales_from(self, entries, param: str) -> list[float]:
        """llama-server's ``[{"id": 0, "scale": 0.5}, ...]`` -> a scale per adapter (those left out: 0)."""
        if not isinstance(entries, list):
            raise APIError(400, f"{param} must be a list of {{\"id\", \"scale\"}} objects", param=param,
                           code="invalid_value")
        scales = [0.0] * len(self.adapters)
        for entry in entries:
            ident = entry.get("id") if isinstance(entry, dict) else None
            scale = entry.get("scale", 0.0) if isinstance(entry, dict) else None
            if not isinstance(ident, int) or isinstance(ident, bool) or not 0 <= ident < len(self.adapters):
                raise APIError(400, f"{param}: id must be one of this server's --lora adapters (0.."
                                    f"{len(self.adapters) - 1}), got {entry!r}", param=param, code="invalid_value")
            if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not abs(scale) <= MAX_SCALE:
                raise APIError(400, f"{param}: scale must be a number in [-{MAX_SCALE:g}, {MAX_SCALE:g}], got {entry!r}",
                               param=param, code="invalid_value")
            scales[ident] = float(scale)
        return scales

    def listing(self) -> list[dict]:
        return [{"id": i, "path": r.lora_path, "scale": s} for i, (r, s) in enumerate(zip(self.adapters, self.scales))]
