"""OpenAI's Responses API (``POST /v1/responses``), answered by the chat completions handler.

A Responses request is rewritten as the chat completion it means (``to_chat``): ``instructions``
become a system message, ``input`` items the messages (a string is one user message; messages
with text content, earlier ``function_call`` items as the assistant's tool calls,
``function_call_output`` items as tool results), function ``tools`` and ``tool_choice`` the chat
ones, ``text.format`` the ``response_format``, ``max_output_tokens`` ``max_completion_tokens``.
The chat handler (``serving.py``) then runs it, so sampling, the model's defaults, speculation,
tools, structured output, priorities and every limit are the same code. Its answer is rewritten
as a Response (``response_body``): the text an ``output_text`` part of one ``message`` item, each
tool call a ``function_call`` item (``call_id`` the chat call's id); a stream's chunks become the
Responses events (``ResponseEvents``: ``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ..., ``response.completed``, each with its ``sequence_number``).

Responses are kept in memory (``responses_store.py``) unless a request sends ``store: false``:
``previous_response_id`` goes on from a kept one's conversation (its instructions not carried
over, as in OpenAI's API), and ``GET`` / ``DELETE /v1/responses/{id}`` read and forget one.
With ``serve --reasoning-parser``, a thinking model's reasoning comes first as a ``reasoning``
item (``reasoning_text`` content; streamed as ``response.reasoning_text.delta``); ``reasoning``
items sent back in ``input`` are skipped, as chat templates drop earlier turns' reasoning.
What is not supported: the request's ``reasoning`` options are accepted and ignored; input
images, files and audio, built-in tools (web search, file search, ...), ``include`` values,
``truncation: "auto"``, ``background`` and ``top_logprobs`` are 400s naming the field.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from specserve.engine.input_checks import MAX_PRIORITY
from specserve.entrypoints.openai.errors import validation_error
from specserve.entrypoints.openai.limits import APIError
from specserve.entrypoints.openai.protocol import ChatCompletionRequest, StrictModel, now, random_id
from specserve.entrypoints.openai.response_format import SSEResponse
from specserve.entrypoints.openai.responses_store import ResponseStore
from specserve.sampling_params import MAX_SEED, MAX_TOP_K

TEXT_PARTS = ("input_text", "output_text", "text")


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

    answer = await serving.chat_completions(chat_request, raw, endpoint="responses")
    if isinstance(answer, SSEResponse):
        events = ResponseEvents(req, serving.model_name, finished).translate(answer.body_iterator)
        return SSEResponse(events, media_type="text/event-stream", on_close=answer.on_close,
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if answer.status_code != 200:
        return answer
    response = response_body(req, json.loads(answer.body))
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
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None
    min_p: float | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_value")


def to_chat(req: ResponsesRequest, history: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """(the chat completions request body ``req`` means, its conversation without the instructions);
    ``history``: the stored conversation of ``previous_response_id``, whose instructions are not
    carried over (as in OpenAI's API). APIError for what it cannot mean."""
    if req.background:
        raise _refuse("background", "background responses are not supported")
    if req.include:
        raise _refuse("include", f"no include values are produced here, got {req.include}")
    if req.truncation == "auto":
        raise _refuse("truncation", "truncation 'auto' is not supported: a prompt too long is a 400")
    if req.top_logprobs:
        raise _refuse("top_logprobs", "top_logprobs is not supported on /v1/responses (chat completions has logprobs)")
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
    if req.tools:
        body["tools"] = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    fmt = (req.text or {}).get("format")
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
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
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
                         "content": _text(item.get("output"), f"{where}.output")})
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


def _text(content, where: str) -> str:
    """A string, or text parts joined (as chat joins them); any other part is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where, code="invalid_value")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _refuse(f"{where}[{j}]", f"only text parts are supported (input_text, output_text), got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        raise _refuse(f"{where}.type", f"only function tools are supported, got {tool.get('type')!r}")
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
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _refuse("text.format.type", f"text.format.type must be text, json_object or json_schema, got "
                                      f"{fmt.get('type')!r}")


# ------------------------------------------------------------------------------------ answers


def _shell(req: ResponsesRequest, rid: str, created: int, model: str) -> dict:
    """The Response object's fields that do not depend on the answer."""
    return {
        "id": rid, "object": "response", "created_at": created, "model": model, "status": "in_progress",
        "output": [], "instructions": req.instructions, "metadata": req.metadata or {},
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
        "previous_response_id": req.previous_response_id, "reasoning": None, "user": req.user, "error": None,
        "incomplete_details": None, "usage": None,
    }


def _finish(response: dict, output: list[dict], finish_reason: str | None, usage: dict | None) -> dict:
    response["output"] = output
    response["status"] = "incomplete" if finish_reason == "length" else "completed"
    if finish_reason == "length":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    if usage is not None:
        response["usage"] = {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    return response


def _message_item(text: str, status: str = "completed") -> dict:
    return {"id": random_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": random_id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _call_item(call: dict, status: str = "completed") -> dict:
    function = call["function"]
    return {"id": random_id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": function["name"], "arguments": function.get("arguments") or ""}


def response_body(req: ResponsesRequest, chat: dict) -> dict:
    """The Response for a chat completion's JSON answer."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = [_reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    output += [_message_item(message["content"])] if message.get("content") else []
    output += [_call_item(call) for call in message.get("tool_calls") or []]
    return _finish(_shell(req, random_id("resp"), chat["created"], chat["model"]), output, choice["finish_reason"],
                   chat.get("usage"))


class ResponseEvents:
    """A chat completion's stream (its ``data:`` chunks) -> the Responses API's events."""

    def __init__(self, req: ResponsesRequest, model: str, on_finished=None):
        self.response = _shell(req, random_id("resp"), now(), model)
        self.on_finished = on_finished      # called with the final response (completed or incomplete)
        self.seq = 0
        self.output: list[dict] = []
        self.item: dict | None = None        # the item being written: a message or a function call
        self.item_text = ""                  # the message item's text so far
        self.finish_reason = None
        self.usage = None

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))

    async def translate(self, chunks: AsyncIterator) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._snapshot())
        yield self._event("response.in_progress", response=self._snapshot())
        try:
            async for raw in chunks:
                text = raw.decode() if isinstance(raw, bytes) else raw
                for line in text.split("\n"):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        for event in self._failed(chunk["error"]):
                            yield event
                        return
                    for event in self._chunk(chunk):
                        yield event
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        for event in self._close():
            yield event
        done = _finish(self.response, self.output, self.finish_reason, self.usage)
        if self.on_finished is not None:
            self.on_finished(done)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=self._snapshot())

    def _chunk(self, chunk: dict):
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._text(delta["reasoning_content"], "reasoning")
            if delta.get("content"):
                yield from self._text(delta["content"], "message")
            for call in delta.get("tool_calls") or []:
                yield from self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _text(self, piece: str, kind: str):
        """A piece of the answer's text (``kind`` "message") or of its reasoning ("reasoning")."""
        if self.item is None or self.item["type"] != kind:
            yield from self._close()
            self.item_text = ""
            if kind == "reasoning":
                self.item = _reasoning_item("", status="in_progress")
                yield self._event("response.output_item.added", output_index=len(self.output), item=self.item)
            else:
                self.item = _message_item("", status="in_progress")
                yield self._event("response.output_item.added", output_index=len(self.output), item=self.item)
                yield self._event("response.content_part.added", item_id=self.item["id"],
                                  output_index=len(self.output), content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []})
        self.item_text += piece
        if kind == "reasoning":
            yield self._event("response.reasoning_text.delta", item_id=self.item["id"], output_index=len(self.output),
                              content_index=0, delta=piece)
        else:
            yield self._event("response.output_text.delta", item_id=self.item["id"], output_index=len(self.output),
                              content_index=0, delta=piece, logprobs=[])

    def _call(self, call: dict):
        function = call.get("function") or {}
        if call.get("id"):                   # a new call: its name comes first, then its arguments
            yield from self._close()
            self.item = _call_item({"id": call["id"], "function": {"name": function.get("name", "")}},
                                   status="in_progress")
            yield self._event("response.output_item.added", output_index=len(self.output), item=self.item)
        if function.get("arguments") and self.item is not None and self.item["type"] == "function_call":
            self.item["arguments"] += function["arguments"]
            yield self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                              output_index=len(self.output), delta=function["arguments"])

    def _close(self):
        item, index = self.item, len(self.output)
        if item is None:
            return
        if item["type"] == "reasoning":
            yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=self.item_text)
            item["content"] = [{"type": "reasoning_text", "text": self.item_text}]
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.item_text, "annotations": []}
            yield self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=self.item_text, logprobs=[])
            yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                              part=part)
            item["content"] = [part]
        else:
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
        item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self.item = None

    def _failed(self, error: dict):
        yield self._event("error", code=error.get("code"), message=error.get("message", ""), param=error.get("param"))
        self.response.update(status="failed", output=self.output,
                             error={"code": error.get("code") or "server_error", "message": error.get("message", "")})
        yield self._event("response.failed", response=self._snapshot())
