"""OpenAI's Responses API (``POST /v1/responses``), answered by the chat completions handler.

A Responses request is rewritten as the chat completion it means (``to_chat``): ``instructions``
become a system message, ``input`` items the messages (a string is one user message; messages
with text content, earlier ``function_call`` items as the assistant's tool calls,
``function_call_output`` items as tool results), function ``tools`` and ``tool_choice`` the chat
ones, ``text.format`` the ``response_format``, ``max_output_tokens`` ``max_completion_tokens``.
The chat handler (``serving.py``) then runs it, so sampling, the model's defaults, speculation,
tools, structured output, priorities and every limit are the same code. Its answer is rewritten
as a Response (``response_answers.response_body``): the text an ``output_text`` part of one
``message`` item, each tool call a ``function_call`` item (``call_id`` the chat call's id); a
stream's chunks become the Responses events (``response_answers.ResponseEvents``).

Responses are kept in memory (``responses_store.py``) unless a request sends ``store: false``:
``previous_response_id`` goes on from a kept one's conversation (its instructions not carried
over, as in OpenAI's API), and ``GET`` / ``DELETE /v1/responses/{id}`` read and forget one.
With ``serve --reasoning-parser``, a thinking model's reasoning comes first as a ``reasoning``
item (``reasoning_text`` content; streamed as ``response.reasoning_text.delta``); ``reasoning``
items sent back in ``input`` are skipped, as chat templates drop earlier turns' reasoning.
``reasoning.effort`` reaches the chat template as chat's ``reasoning_effort`` does; its other
options are ignored. ``include: ["message.output_text.logprobs"]`` (or ``top_logprobs``, 0-20
alternatives) adds the answer's log-probabilities to its ``output_text`` part and to each
``response.output_text.delta`` (``response_answers.AnswerLogprobs``). What is not supported: input
images, files and audio, built-in tools (web search, file search, ...), other ``include`` values
(but ``reasoning.encrypted_content``: nothing to add), ``truncation: "auto"`` and ``background``
are 400s naming the field.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from specserve.entrypoints.openai.errors import validation_error
from specserve.entrypoints.openai.limits import APIError
from specserve.entrypoints.openai.protocol import (
    ChatCompletionRequest, Priority, RepetitionPenalty, Seed, StrictModel, TopK,
)
from specserve.entrypoints.openai.response_answers import ResponseEvents, response_body
from specserve.entrypoints.openai.response_format import SSEResponse
from specserve.entrypoints.openai.responses_store import ResponseStore

TEXT_PARTS = ("input_text", "output_text", "text")
# include values answered with nothing more: reasoning items carry their text in the clear, so there is
# no encrypted reasoning to add (agent clients that keep no state, such as Codex, ask for it)
INCLUDE_NOTHING_TO_ADD = ("reasoning.encrypted_content",)
INCLUDE_LOGPROBS = "message.output_text.logprobs"     # the answer's tokens' log-probabilities


async def create_response(serving, store: ResponseStore, req: "ResponsesRequest", raw: Request) -> Response:
    """POST /v1/responses: ``req`` as a chat completion through ``serving`` (an ``OpenAIServing``),
    its answer as a Response, or its stream as the Responses events; kept in ``store`` unless
    the request says ``store: false``."""
    history = []
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise APIError(404, f"previous response {req.previous_response_id!r} not found (this server keeps the "
                                f"latest {store.max_entries} responses, in memory)",
                           param="previous_response_id", code="not_found")
        history = entry[1]
    body, conversation = to_chat(req, history)
    try:
        chat_request = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    keep = store.enabled and req.store is not False

    def finished(response: dict) -> None:
        if keep and response["status"] != "failed":
            response["store"] = True
            answer: list[dict] = []
            for i, item in enumerate(response["output"]):
                _add_item(answer, item, f"output[{i}]")
            store.put(response, conversation + answer)

    try:
        answer = await serving.chat_completions(chat_request, raw, endpoint="responses")
    except APIError as e:            # the chat handler names its own fields: the conversation is the input here
        if e.param and e.param.startswith("messages"):
            e.param = "input"
        raise
    if isinstance(answer, SSEResponse):
        events = ResponseEvents(req, serving.answer_model(req), finished, serving.reasoning,
                                logprobs=wants_logprobs(req)).translate(answer.body_iterator)
        return SSEResponse(events, on_close=answer.on_close)
    if answer.status_code != 200:
        return answer
    response = response_body(req, json.loads(answer.body), serving.reasoning)
    finished(response)
    return JSONResponse(response)


class ResponsesRequest(StrictModel):
    """POST /v1/responses: the fields OpenAI's API has, and vLLM's sampling extensions."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None        # prefix caching needs no key: every prompt is looked up
    service_tier: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tool_calls: int | None = None
    # vLLM's extensions
    top_k: TopK | None = None
    min_p: float | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    priority: Priority = 0


def wants_logprobs(req: "ResponsesRequest") -> bool:
    """The answer's log-probabilities asked for: ``include`` names them, or ``top_logprobs`` is set."""
    return INCLUDE_LOGPROBS in (req.include or []) or bool(req.top_logprobs)


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_value")


def to_chat(req: ResponsesRequest, history: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """(the chat completions request body ``req`` means, its conversation without the instructions);
    ``history``: the stored conversation of ``previous_response_id``, whose instructions are not
    carried over (as in OpenAI's API). APIError for what it cannot mean."""
    if req.background:
        raise _refuse("background", "background responses are not supported")
    unknown = [v for v in req.include or [] if v not in INCLUDE_NOTHING_TO_ADD + (INCLUDE_LOGPROBS,)]
    if unknown:
        raise _refuse("include", f"these include values are not produced here: {unknown}")
    if req.truncation == "auto":
        raise _refuse("truncation", "truncation 'auto' is not supported: a prompt too long is a 400")
    if req.max_tool_calls is not None:
        raise _refuse("max_tool_calls", "max_tool_calls is not supported")
    conversation = [dict(m) for m in history or []]
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        _add_item(conversation, item, f"input[{i}]")
    if not conversation:
        raise APIError(400, "input holds no message", param="input", code="invalid_value")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {"messages": messages, "stream": bool(req.stream), "priority": req.priority}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "user",
                 "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if wants_logprobs(req):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    effort = (req.reasoning or {}).get("effort")
    if isinstance(effort, str):
        body["reasoning_effort"] = effort      # the chat template's variable, as chat's reasoning_effort
    if req.tools:
        body["tools"] = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
        named = body["tool_choice"]["function"]["name"] if isinstance(body["tool_choice"], dict) else None
        if named is not None and named not in {t.get("name") for t in req.tools or []}:
            raise APIError(400, f"tool_choice names the function {named!r}, which is not among the tools",
                           param="tool_choice", code="invalid_value")
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object with a type", param="text.format", code="invalid_value")
    if fmt is not None and fmt.get("type") != "text":
        body["response_format"] = _response_format(fmt)
    return body, conversation


def _add_item(messages: list[dict], item: dict, where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                           param=f"{where}.role", code="invalid_value")
        messages.append({"role": role, "content": joined_text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": _field(item, "call_id", where), "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":      # the same turn's text, or its other calls
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                         "content": joined_text(item.get("output"), f"{where}.output")})
    elif kind == "reasoning":
        return      # no family served here reads its own reasoning back
    else:
        raise _refuse(f"{where}.type", f"input items of type {kind!r} are not supported (message, function_call, "
                                       f"function_call_output)")


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{name} must be a string", param=f"{where}.{name}", code="invalid_value")
    return value


def joined_text(content, where: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """A string, or the text of its parts of ``kinds`` joined (as chat joins them); any other part
    is a 400 naming where it is (the Responses API's and Anthropic's content alike)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where, code="invalid_value")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _refuse(f"{where}[{j}]", f"only text parts are supported ({', '.join(kinds)}), got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", param=f"{where}[{j}].text", code="invalid_value")
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        raise _refuse(f"{where}.type", f"only function tools are supported, got {tool.get('type')!r}")
    if not isinstance(tool.get("name"), str):
        raise APIError(400, f"{where}.name must be a string", param=f"{where}.name", code="invalid_value")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _refuse("tool_choice", f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                                     f"\"name\": ...}}, got {choice!r}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(fmt: dict) -> dict:
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema must be a JSON schema (an object)", param="text.format.schema",
                           code="invalid_value")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _refuse("text.format.type", f"text.format.type must be text, json_object or json_schema, got "
                                      f"{fmt.get('type')!r}")
