"""llama-server's own endpoints, ``POST /completion`` and ``POST /infill`` (and ``GET /props``), over the completions
handler: the native API that llama.cpp's clients call (editor code completion such as
llama.vscode sends ``/infill``), so they can use a speculating specserve server as they are.

A request is rewritten as the ``/v1/completions`` request it means (``to_completions``):
``/infill``'s ``input_extra`` files, ``input_prefix``, ``input_suffix`` and ``prompt`` (the
middle's start) become the fill-in-the-middle prompt (``fill_in_middle.infill_prompt``) with the
model's end-of-middle tokens as stop tokens; ``n_predict`` (-1: up to the context) is
``max_tokens``; the sampling options keep their meaning (``repeat_penalty`` as vLLM's
repetition penalty, over the whole context: ``repeat_last_n`` is not applied), ``grammar``
(GBNF) and ``json_schema`` constrain the output, ``n_probs`` asks for log-probabilities. The
completions handler runs it streamed, and its chunks are read as they come
(``answer_from_stream``), which gives llama-server's timings and its two code-completion
cut-offs: ``n_indent`` (a new line indented less than that ends the answer, the line cut) and
``t_max_predict_ms`` (after a new line, the answer ends once generating took that long).
Leaving early aborts the request.

``lora`` (``[{"id": 0, "scale": 0.5}]``) sets the request's scales of the server's ``--lora`` files
(``lora_modules.LlamaLoras``; those left out: 0). Options specserve cannot honour exactly are refused
with a 400 naming them (DRY, XTC, Mirostat, dynamic temperature, locally typical sampling,
post-sampling probabilities, several prompts); ``model`` (as llama-server, one model whatever is named), ``cache_prompt``
(the prefix cache always reuses), ``samplers`` (specserve's order:
penalties, top-k, top-p, min-p, temperature), ``t_max_prompt_ms``, ``id_slot``, ``n_keep``,
``n_cache_reuse``, ``min_keep`` and ``timings_per_token`` are accepted and change nothing.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from specserve.entrypoints.fill_in_middle import fim_tokens, infill_prompt
from specserve.entrypoints.openai.errors import validation_error
from specserve.entrypoints.openai.limits import APIError, with_names
from specserve.entrypoints.openai.protocol import CompletionRequest, StrictModel
from specserve.entrypoints.openai.llama_native_answers import NativeAnswers
from specserve.entrypoints.openai.response_format import SSEResponse


class ExtraChunk(StrictModel):
    filename: str = ""
    text: str = ""


class NativeRequest(StrictModel):
    """POST /completion and /infill: llama-server's options (its defaults)."""

    model: str | None = None
    prompt: str | list[int] = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=1024)] = []
    n_predict: int = -1
    n_cmpl: Annotated[int, Field(ge=1, le=16)] = 1      # completions of the prompt (an array of answers)
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: Annotated[list[str], Field(max_length=64)] = []
    seed: int = -1
    ignore_eos: bool = False
    logit_bias: dict[str, float | bool] | list[list[Any]] | None = None
    n_probs: int = 0
    stream: bool = False
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_indent: Annotated[int, Field(ge=0)] = 0
    t_max_predict_ms: Annotated[int, Field(ge=0)] = 0
    return_tokens: bool = False
    response_fields: list[str] | None = None
    post_sampling_probs: bool = False
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    mirostat: int = 0
    dynatemp_range: float = 0.0
    # accepted, changing nothing (module docstring)
    cache_prompt: bool = True
    samplers: list[str] | None = None
    t_max_prompt_ms: int = 0
    id_slot: int = -1
    n_keep: int = 0
    n_cache_reuse: int = 0
    min_keep: int = 0
    timings_per_token: bool = False
    lora: list[Any] | None = None


# the completions request's fields -> llama-server's, for the errors
NAMES = {"logprobs": "n_probs", "repetition_penalty": "repeat_penalty", "max_tokens": "n_predict"}
# options whose only supported value is their default (the sampler is off)
_OFF = {"typical_p": 1.0, "post_sampling_probs": False, "dry_multiplier": 0.0, "xtc_probability": 0.0,
        "mirostat": 0, "dynatemp_range": 0.0}


async def native_completion(serving, req: NativeRequest, raw: Request, infill: bool) -> Response:
    """POST /completion (``infill`` False) or /infill: ``req`` through the completions handler."""
    # tokenizing an editor's context files takes a while: off the event loop
    body, prompt_ids = await serving.async_engine.run_off_thread(to_completions, serving, req, infill)
    mix = serving.llama_loras.mix(serving.llama_loras.scales_from(req.lora, "lora")) if req.lora is not None else None
    names = {**NAMES, "structured_outputs": "grammar" if req.grammar is not None else "json_schema"}
    try:
        completion_request = CompletionRequest.model_validate(body)
        answer = await serving.completions(completion_request, raw, endpoint="infill" if infill else "completion",
                                           lora_mix=mix)
    except ValidationError as e:
        raise with_names(validation_error(e), names) from None
    except APIError as e:
        raise with_names(e, names) from None
    if not isinstance(answer, SSEResponse):
        return answer                                 # an error the handler answered itself
    state = NativeAnswers(serving, req, prompt_ids)
    if req.stream:
        return SSEResponse(state.events(answer.body_iterator), on_close=answer.on_close)
    try:
        async with aclosing(state.pieces(answer.body_iterator)) as pieces:
            async for _ in pieces:
                if await raw.is_disconnected():       # nobody to answer: leaving aborts the request
                    return Response(status_code=499)
    finally:
        answer.on_close()
    return JSONResponse(state.final())


def props(serving) -> dict:
    """GET /props: llama-server's server properties that its clients read (the context size
    above all: llama.vscode sizes its prompts by ``default_generation_settings.n_ctx``)."""
    from specserve import __version__

    engine = serving.engine
    defaults = NativeRequest()
    settings = {k: getattr(defaults, k) for k in ("n_predict", "temperature", "top_k", "top_p", "min_p",
                                                    "repeat_penalty", "presence_penalty", "frequency_penalty")}
    return {"default_generation_settings": {"n_ctx": engine.max_model_len, "params": settings},
            "total_slots": engine.config.max_num_seqs, "model_alias": serving.model_name,
            "model_path": engine.model_name, "chat_template": getattr(serving.tokenizer, "chat_template", None) or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"specserve {__version__}"}


def to_completions(serving, req: NativeRequest, infill: bool) -> tuple[dict, list[int] | str]:
    """(the /v1/completions body ``req`` means, its prompt); APIError for what it cannot mean."""
    for name, off in _OFF.items():
        if getattr(req, name) != off:
            raise APIError(400, f"{name} is not supported here (only {off!r}, the sampler off)", param=name,
                           code="unsupported_value")
    if req.lora and not serving.llama_loras.adapters:
        raise APIError(400, "this server has no --lora adapters (start it with --lora FILE; adapters by name: "
                            "--lora-modules and model)", param="lora", code="invalid_value")
    if req.grammar is not None and req.json_schema is not None:
        raise APIError(400, "grammar and json_schema cannot go together", param="json_schema", code="invalid_value")
    engine = serving.engine
    tokenizer = serving.tokenizer
    max_tokens = req.n_predict if req.n_predict > 0 else None
    # ``model`` is not checked: llama-server serves one model whatever a request names (editors send theirs)
    body: dict[str, Any] = {"temperature": req.temperature, "top_p": req.top_p,
                            "top_k": req.top_k if req.top_k > 0 else -1, "min_p": req.min_p,
                            "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                            "ignore_eos": req.ignore_eos, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                            "specserve": {"provenance": True}}
    if req.n_cmpl > 1:
        body["n"] = req.n_cmpl
    if req.repeat_penalty != 1.0:
        body["repetition_penalty"] = req.repeat_penalty
    if req.stop:
        body["stop"] = req.stop
    if req.seed >= 0:
        body["seed"] = req.seed
    if req.n_probs > 0:
        body["logprobs"] = req.n_probs
    if req.grammar is not None:
        body["structured_outputs"] = {"grammar": req.grammar}
    if req.json_schema is not None:
        body["structured_outputs"] = {"json": req.json_schema}
    if req.logit_bias:
        body["logit_bias"] = _logit_bias(req.logit_bias, tokenizer)
    if infill:
        if fim_tokens(tokenizer) is None:
            raise APIError(400, "this model has no fill-in-the-middle tokens: /infill needs a code model trained on "
                                "fill-in-the-middle, such as Qwen2.5-Coder", param="input_prefix", code="unsupported_value")
        if not isinstance(req.prompt, str):
            raise APIError(400, "prompt must be text on /infill (the middle's start)", param="prompt",
                           code="invalid_value")
        budget = engine.max_model_len - (max_tokens or 1)
        prompt = infill_prompt(tokenizer, req.input_prefix, req.input_suffix,
                               [(c.filename, c.text) for c in req.input_extra], req.prompt, budget)
        body["stop_token_ids"] = list(fim_tokens(tokenizer).ends)
    else:
        if req.input_prefix or req.input_suffix or req.input_extra:
            raise APIError(400, "input_prefix, input_suffix and input_extra belong to /infill", param="input_prefix",
                           code="invalid_value")
        prompt = req.prompt
        if isinstance(prompt, str) and not prompt:
            raise APIError(400, "prompt is required", param="prompt", code="invalid_value")
    body["prompt"] = prompt
    length = len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))
    # n_predict 0 evaluates the prompt into the cache (editors warm it so): one token, not answered
    body["max_tokens"] = 1 if req.n_predict == 0 else (max_tokens or max(1, engine.max_model_len - length))
    return body, prompt


def _logit_bias(bias, tokenizer) -> dict[str, float]:
    """llama-server's biases (``{"id or text": v}`` or ``[[id or text, v], ...]``; ``false``: never)
    -> OpenAI's ``{"id": v}``; a text biases each of its tokens."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    out: dict[str, float] = {}
    for pair in pairs:
        key, value = tuple(pair) if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
        if not isinstance(key, (int, str)) or not isinstance(value, (bool, int, float)):
            raise APIError(400, "logit_bias entries are [token id or text, bias or false]", param="logit_bias",
                           code="invalid_value")
        value = -100.0 if value is False else float(value)
        if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
            ids = [int(key)]
        else:
            ids = tokenizer.encode(str(key), add_special_tokens=False)
        for tid in ids:
            out[str(tid)] = max(-100.0, min(100.0, value))
    return out
