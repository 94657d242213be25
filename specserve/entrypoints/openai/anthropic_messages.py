"""Anthropic's Messages API (``POST /v1/messages``), answered by the chat completions handler.

Clients written for Anthropic's API (its SDKs, coding agents that take a base URL) can use a
specserve server as they would vLLM's or llama-server's Anthropic endpoint. A Messages request
is rewritten as the chat completion it means (``to_chat``): ``system`` becomes a system
message; ``messages`` the conversation, where an assistant's ``tool_use`` blocks are its tool
calls and a user's ``tool_result`` blocks are tool messages (before the user's text);
``tools`` (``input_schema``) the chat functions; ``tool_choice`` auto / any / tool / none the
chat ``auto`` / ``required`` / named / ``none`` (``disable_parallel_tool_use`` is
``parallel_tool_calls: false``); ``max_tokens`` ``max_completion_tokens``; ``stop_sequences``
``stop``; ``thinking`` the chat template's ``enable_thinking``; ``output_config.format`` (a
JSON schema) the ``response_format`` and ``output_config.effort`` the template's
``reasoning_effort``; ``cache_control`` and the fields of tiers, regions, speeds and workspaces
are accepted and change nothing (the prefix cache needs no marks). The chat handler
(``serving.py``) runs it, so sampling, the model's defaults, speculation, tools, priorities and
every limit are the same code; ``anthropic_answers.py`` turns its answer (or stream) into a
Message (or Anthropic's events). ``count_tokens`` answers ``POST /v1/messages/count_tokens``.

Not supported, each a 400 naming the field: images and documents, server tools (web search,
code execution: a ``type`` other than custom), ``container`` and ``mcp_servers``.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from specserve.entrypoints.openai.anthropic_answers import MessageEvents, message_body
from specserve.entrypoints.openai.errors import validation_error
from specserve.entrypoints.openai.limits import APIError, with_names
from specserve.entrypoints.openai.protocol import ChatCompletionRequest, Seed, StrictModel, TokenizeRequest, TopK
from specserve.entrypoints.openai.response_format import SSEResponse
from specserve.entrypoints.openai.responses import joined_text

TEXT = ("text",)      # Anthropic's text blocks


class MessagesRequest(StrictModel):
    """POST /v1/messages: the fields of Anthropic's API."""

    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=64)] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    seed: Seed | None = None                    # specserve's (and chat's): a reproducible sample
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # accepted and ignored: the prefix cache needs no marks; no tiers, regions, speeds or workspaces here
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None


class CountTokensRequest(StrictModel):
    """POST /v1/messages/count_tokens: a Messages request's conversation, without max_tokens."""

    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


async def create_message(serving, req: MessagesRequest, raw: Request) -> Response:
    """POST /v1/messages: ``req`` as a chat completion through ``serving`` (an ``OpenAIServing``),
    its answer as a Message, or its stream as Anthropic's events."""
    chat_request = _validated(to_chat(req))
    answer = await _chat(serving, chat_request, raw)
    if isinstance(answer, SSEResponse):
        events = MessageEvents(serving.answer_model(req), req.stop_sequences).translate(answer.body_iterator)
        return SSEResponse(events, on_close=answer.on_close)
    if answer.status_code != 200:
        return answer
    return JSONResponse(message_body(json.loads(answer.body), req.stop_sequences or []))


async def count_tokens(serving, req: CountTokensRequest, raw: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt tokens the request's conversation renders to."""
    body = to_chat(MessagesRequest(max_tokens=1, **req.model_dump(exclude_none=True)))
    fields = {k: body[k] for k in ("model", "messages", "tools", "chat_template_kwargs") if k in body}
    try:
        tokenize = TokenizeRequest.model_validate(fields)
    except ValidationError as e:
        raise _input_error(validation_error(e)) from None
    answer = await serving.tokenize(tokenize, raw)
    return JSONResponse({"input_tokens": json.loads(answer.body)["count"]})


async def _chat(serving, chat_request: ChatCompletionRequest, raw: Request) -> Response:
    try:
        return await serving.chat_completions(chat_request, raw, endpoint="messages")
    except APIError as e:
        raise _input_error(e) from None


def _validated(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _input_error(validation_error(e)) from None


# the chat request's fields -> the Messages API's, for the errors
NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format",
         "chat_template_kwargs": "thinking"}


def _input_error(e: APIError) -> APIError:
    """The chat handler names its own fields; here they are the Messages request's, and the
    conversation is ``messages`` as sent."""
    if e.param and e.param.startswith("messages"):
        e.param = "messages"
        return e
    return with_names(e, NAMES)


THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_value")


def to_chat(req: MessagesRequest) -> dict:
    """The chat completions request body ``req`` means; APIError for what it cannot mean."""
    if req.container is not None:
        raise _refuse("container", "containers (code execution) are not supported")
    if req.mcp_servers:
        raise _refuse("mcp_servers", "MCP servers are not supported")
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": joined_text(req.system, "system", TEXT)})
    for i, message in enumerate(req.messages):
        _add_message(messages, message, f"messages[{i}]")
    body: dict[str, Any] = {"messages": messages, "max_completion_tokens": req.max_tokens, "stream": bool(req.stream)}
    if req.stream:   # every chunk with its usage: the first one gives message_start its input_tokens
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    for name in ("model", "temperature", "top_p", "top_k", "seed"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.metadata and isinstance(req.metadata.get("user_id"), str):
        body["user"] = req.metadata["user_id"]
    if req.tools:
        body["tools"] = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body.update(_chat_tool_choice(req.tool_choice, {t["function"]["name"] for t in body.get("tools", [])}))
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in THINKING_TYPES:
            raise APIError(400, f"thinking.type must be one of {list(THINKING_TYPES)}, got {kind!r}",
                           param="thinking.type", code="invalid_value")
        body["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    output = req.output_config or {}
    if isinstance(output.get("effort"), str):
        body["reasoning_effort"] = output["effort"]     # the chat template's variable, as chat's
    fmt = output.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                           param="output_config.format", code="invalid_value")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return body


def _add_message(messages: list[dict], message: dict, where: str) -> None:
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role must be user or assistant, got {role!r}", param=f"{where}.role",
                       code="invalid_value")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks",
                       param=f"{where}.content", code="invalid_value")
    text, calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise APIError(400, f"{at} must be a content block (an object with a type)", param=at, code="invalid_value")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise APIError(400, f"{at}.text: a text block needs its text", param=f"{at}.text", code="invalid_value")
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            args = block.get("input", {})
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(args, dict):
                raise APIError(400, f"{at}: a tool_use block needs an id, a name and an input object", param=at,
                               code="invalid_value")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{at}: a tool_result block needs its tool_use_id", param=f"{at}.tool_use_id",
                               code="invalid_value")
            result = block.get("content", "")
            output = joined_text(result, f"{at}.content", TEXT) if result else ""
            if block.get("is_error"):
                output = f"Error: {output}"
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": output})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue       # earlier turns' reasoning: chat templates drop it
        else:
            raise APIError(400, f"{at}: {kind!r} blocks are not supported in a {role} message", param=at,
                           code="unsupported_value")
    if text or calls or not content:
        entry: dict[str, Any] = {"role": role, "content": "".join(text) if text or not calls else None}
        if calls:
            entry["tool_calls"] = calls
        messages.append(entry)


def _chat_tool(tool: dict, where: str) -> dict:
    if tool.get("type") not in (None, "custom"):
        raise _refuse(f"{where}.type", f"only custom tools (name, input_schema) are supported, got {tool.get('type')!r}")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(400, f"{where}.name: a tool needs a name", param=f"{where}.name", code="invalid_value")
    schema = tool.get("input_schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise APIError(400, f"{where}.input_schema must be a JSON schema object", param=f"{where}.input_schema",
                       code="invalid_value")
    function = {"name": tool["name"], "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict, names: set[str]) -> dict:
    kind = choice.get("type")
    fields: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    if kind in ("auto", "any", "none"):
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    elif kind == "tool":
        name = choice.get("name")
        if name not in names:
            raise APIError(400, f"tool_choice names the tool {name!r}, which is not among the tools",
                           param="tool_choice.name", code="invalid_value")
        fields["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                       param="tool_choice.type", code="invalid_value")
    return fields


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
