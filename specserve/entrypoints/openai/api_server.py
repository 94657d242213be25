"""An OpenAI-compatible HTTP server over specserve's engine: the app and its routes.

    specserve serve --speculative-method ngram --num-speculative-tokens 4 --port 8000

Routes: POST /v1/completions, POST /v1/chat/completions (``stream`` true or
false; server-sent events ``data: {...}`` ending with ``data: [DONE]``), POST /v1/embeddings
(``embeddings.py``; llama-server's POST /embedding and /embeddings too), POST /v1/responses
(OpenAI's Responses API over the chat handler: ``responses.py``; GET and DELETE
/v1/responses/{id} for the kept ones), POST /v1/messages and /v1/messages/count_tokens
(Anthropic's Messages API over the chat handler: ``anthropic_messages.py``; its errors in
Anthropic's shape, and its clients' ``x-api-key`` taken as the key), POST /completion and
/infill and GET /props (llama-server's own API: ``llama_native.py``), POST /tokenize and /detokenize (vLLM's), GET /v1/models (and /v1/models/{id}; LoRA
adapters too, which requests name in ``model``: ``lora_modules.py``, with POST /v1/load_lora_adapter and
/v1/unload_lora_adapter where runtime updating is allowed), GET
/v1/specserve/info (model and speculation), GET /version, GET /health,
GET /metrics (Prometheus), and the chat page at /. The request extension
``"specserve": {"provenance": true}`` adds how each token came (``provenance.py``).
Requests run on one ``AsyncLLMEngine`` (continuous batching); a client that goes away aborts its
request, which frees its KV blocks. Errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``, in bodies and in streams
alike (``code`` is always a string). What is checked before a request reaches
the engine, and each limit's status code: ``limits.py`` and docs/serving.md.

This module builds the app (``build_app``: routes, error handlers, the API-key
check); the rest of the server, one role a module:

    serving.py          the completions and chat handlers, bodies and streams (OpenAIServing)
    request_streams.py  a completion's engine requests: queue, merge, n samples, collect
    response_format.py  one choice's streaming state, logprobs, usage, server-sent events
    errors.py           OpenAI's error shape; exceptions -> APIError
    metrics.py          Prometheus metrics (ServerMetrics)
    serve.py            ``specserve serve``: args -> engine -> app -> uvicorn (run_server)
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve import __version__
from specserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError, RequestFailedError
from specserve.entrypoints.openai.chat_page import add_chat_page
from specserve.entrypoints.openai.errors import engine_error, error_body, error_response, validation_error
from specserve.entrypoints.openai.limits import APIError, ClientGone, ServerLimits, read_json
from specserve.entrypoints.openai.metrics import ServerMetrics
from specserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    NativeEmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from specserve.entrypoints.openai.embeddings import create_embeddings, native_embeddings
from specserve.entrypoints.openai.lora_modules import (
    add_static_modules, load_adapter, runtime_updating_allowed, unload_adapter,
)
from specserve.entrypoints.openai.reasoning import PARSERS
from specserve.entrypoints.openai.response_format import hold_back
from specserve.entrypoints.openai.responses import ResponsesRequest, create_response
from specserve.entrypoints.openai.llama_native import NativeRequest, native_completion, props
from specserve.entrypoints.openai.anthropic_messages import (
    CountTokensRequest, MessagesRequest, anthropic_error, count_tokens, create_message,
)
from specserve.entrypoints.openai.responses_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from specserve.entrypoints.openai.serving import OpenAIServing

# Importable from here as before the split (tests import hold_back from this module).
__all__ = ["build_app", "CORSOptions", "hold_back", "OpenAIServing", "ServerMetrics", "error_body", "error_response"]

logger = logging.getLogger(__name__)


@dataclass
class CORSOptions:
    """Which web pages may call the server from a browser (vLLM's ``--allowed-origins`` and its
    siblings). No origin by default, where vLLM allows every one: a server without an API key on
    a laptop would otherwise answer any page its user opens."""

    allowed_origins: list[str] = field(default_factory=list)    # ["*"]: every origin
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def __post_init__(self):
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials needs the origins named: browsers refuse credentials with the "
                             "wildcard origin '*'")


# Routes outside /v1 that generate or read the model, guarded by the key too (llama-server guards its
# own so; the chat page, its static files, /health, /metrics and /version stay open)
KEYED_ROUTES = ("/completion", "/infill", "/props", "/tokenize", "/detokenize", "/lora-adapters", "/embedding",
                "/embeddings")


class _APIKeyMiddleware:
    """401 for /v1/* and ``KEYED_ROUTES`` without ``Authorization: Bearer <key>`` (or ``x-api-key``)
    (pure ASGI: streaming-safe)."""

    def __init__(self, app, api_key: str, on_reject=None):
        self.app = app
        self.api_key = api_key.encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path in KEYED_ROUTES) \
                and scope.get("method") != "OPTIONS":
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            scheme, _, key = auth.partition(b" ")
            if scheme.lower() != b"bearer":
                key = headers.get(b"x-api-key", b"")      # Anthropic's clients send the key so
            if not hmac.compare_digest(key.strip(), self.api_key):
                if self.on_reject is not None:
                    self.on_reject()
                message = "missing API key (send 'Authorization: Bearer <key>')" if not key else "invalid API key"
                if path.startswith("/v1/messages"):
                    response = JSONResponse(anthropic_error(401, message), status_code=401)
                else:
                    response = error_response(401, message, "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(llm_or_engine, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None, cors: CORSOptions | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, reasoning_parser: str | None = None,
              lora_modules: list[tuple[str, str]] | None = None,
              llama_loras: list[tuple[str, float]] | None = None) -> FastAPI:
    """The FastAPI app over an ``LLM``, ``LLMEngine`` or ``AsyncLLMEngine``.

    Apps built over the same engine share one engine loop (one step at a time).
    ``served_model_name``: the name (or names) requests may use in ``model``;
    default: the engine's model name. ``limits``: body size, read time, JSON
    depth, prompts per request (default: ``ServerLimits.from_env()``). ``cors``: the
    web origins whose pages may call the server (default: none). ``max_stored_responses``: the
    Responses API's responses kept in memory (``responses_store.py``; 0: none). ``reasoning_parser``:
    "deepseek_r1" or "qwen3", a thinking model's reasoning apart from its answer (``reasoning.py``).
    ``lora_modules``: (name, PEFT adapter folder) pairs requests may name in ``model`` (the engine needs
    enable_lora), loaded now (``lora_modules.py``); ``llama_loras``: llama-server's ``--lora`` files and
    their global scales, applied to requests that name no adapter.
    """
    if reasoning_parser is not None and reasoning_parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; choose from {sorted(PARSERS)}")
    async_engine = AsyncLLMEngine.from_engine(llm_or_engine)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if not names:
        names = [async_engine.engine.model_name]
    limits = limits if limits is not None else ServerLimits.from_env()
    serving = OpenAIServing(async_engine, names, limits, PARSERS.get(reasoning_parser))
    add_static_modules(serving, lora_modules or [], llama_loras or [])
    stored = ResponseStore(max_stored_responses)
    m, ln = serving.metrics, serving.model_name

    app = FastAPI(title="specserve OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.async_engine = async_engine
    app.state.limits = limits                 # uvicorn_config() reads the header limits from here

    def fail(e: APIError, anthropic: bool = False) -> JSONResponse:
        m.errors.labels(ln, str(e.status)).inc()
        if anthropic:     # Anthropic's error shape, for its Messages API's clients
            return JSONResponse(anthropic_error(e.status, e.message), status_code=e.status)
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        m.errors.labels(ln, str(exc.status_code)).inc()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, str(exc.status_code))
        return error_response(exc.status_code, str(exc.detail), kind, code=code)

    async def parse(raw: Request, model_cls: type[BaseModel]):
        data = await read_json(raw, limits)
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None

    async def handle(raw: Request, model_cls, endpoint, anthropic: bool = False) -> Response:
        try:
            request = await parse(raw, model_cls)
            return await endpoint(request, raw)
        except APIError as e:
            return fail(e, anthropic)
        except ClientGone:  # disconnected mid-upload: nobody to answer, nothing to log
            m.errors.labels(ln, "499").inc()
            return Response(status_code=499)
        except (EngineDeadError, EngineStepError, RequestFailedError) as e:
            return fail(engine_error(e), anthropic)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never crash the server on one request
            logger.exception("request failed")
            return fail(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error", code="internal_error"),
                        anthropic)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await handle(raw, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await handle(raw, ChatCompletionRequest, serving.chat_completions)

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request):
        return await handle(raw, EmbeddingRequest, functools.partial(create_embeddings, serving))

    @app.post("/embedding")
    @app.post("/embeddings")
    async def native_embedding(raw: Request):
        return await handle(raw, NativeEmbeddingRequest, functools.partial(native_embeddings, serving))

    @app.post("/v1/responses")
    async def responses(raw: Request):
        return await handle(raw, ResponsesRequest, functools.partial(create_response, serving, stored))

    @app.post("/v1/messages")
    async def messages(raw: Request):
        return await handle(raw, MessagesRequest, functools.partial(create_message, serving), anthropic=True)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(raw: Request):
        return await handle(raw, CountTokensRequest, functools.partial(count_tokens, serving), anthropic=True)

    @app.post("/completion")
    async def native_completion_route(raw: Request):
        return await handle(raw, NativeRequest, functools.partial(native_completion, serving, infill=False))

    @app.post("/infill")
    async def native_infill(raw: Request):
        return await handle(raw, NativeRequest, functools.partial(native_completion, serving, infill=True))

    @app.get("/props")
    async def llama_props():
        return JSONResponse(props(serving))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        entry = stored.get(response_id)
        if entry is None:
            return fail(APIError(404, f"response {response_id!r} not found", param="response_id", code="not_found"))
        return JSONResponse(entry[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not stored.delete(response_id):
            return fail(APIError(404, f"response {response_id!r} not found", param="response_id", code="not_found"))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await handle(raw, TokenizeRequest, serving.tokenize)

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await handle(raw, DetokenizeRequest, serving.detokenize)

    def model_card(model_id: str) -> ModelCard:
        engine, lora = async_engine.engine, serving.loras.get(model_id)
        if lora is not None:    # an adapter: its folder, and the base model as its parent (vLLM's)
            return ModelCard(id=model_id, root=lora.lora_path, parent=names[0], max_model_len=engine.max_model_len)
        return ModelCard(id=model_id, root=engine.model_name, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def models():
        cards = [model_card(n) for n in names + list(serving.loras.by_name)]
        return JSONResponse(ModelList(data=cards).model_dump(exclude_none=True))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        try:
            serving.check_model(model_id)
        except APIError as e:
            return fail(e)
        return JSONResponse(model_card(model_id).model_dump(exclude_none=True))

    @app.get("/lora-adapters")
    async def lora_adapters():
        return JSONResponse(serving.llama_loras.listing())

    @app.post("/lora-adapters")
    async def set_lora_adapters(raw: Request):
        try:
            serving.llama_loras.scales = serving.llama_loras.scales_from(await read_json(raw, limits, (list,)), "body")
        except APIError as e:
            return fail(e)
        return JSONResponse({"success": True})

    if runtime_updating_allowed():   # vLLM's runtime LoRA endpoints, behind the same switch
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw: Request):
            return await handle(raw, LoadLoraAdapterRequest, functools.partial(load_adapter, serving))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request):
            return await handle(raw, UnloadLoraAdapterRequest, functools.partial(unload_adapter, serving))

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    @app.get("/v1/specserve/info")
    async def info():
        return JSONResponse(serving.info())

    @app.get("/health")
    async def health():
        if async_engine.errored:
            return error_response(503, f"the engine is dead: {async_engine.dead_error!r}", "server_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    add_chat_page(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, on_reject=lambda: m.errors.labels(ln, "401").inc())
    if cors is not None and cors.allowed_origins:   # outermost: a 401 carries the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    return app
