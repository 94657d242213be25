"""A chat completion's answer as an OpenAI Responses API response, and its stream as the
Responses events (``responses.py`` rewrites the request; this module the answer).

``response_body``: the chat answer's reasoning (with a reasoning parser), text and tool calls as
``reasoning``, ``message`` and ``function_call`` items, ``status`` incomplete when
``max_output_tokens`` cut it, ``usage`` in the Responses names. ``ResponseEvents``: the chat
stream's ``data:`` chunks read as they come, each item opened, filled by deltas and closed
(``response.output_item.added``, ``...delta``, ``...done``, ``response.output_item.done``)
between ``response.created`` / ``response.in_progress`` and ``response.completed`` (or
``response.incomplete``; ``error`` and ``response.failed`` when the chat stream reports one),
every event numbered by ``sequence_number``.
"""
from __future__ import annotations

import json
from contextlib import aclosing
from typing import AsyncIterator

from specserve.entrypoints.openai.protocol import now, random_id
from specserve.entrypoints.openai.response_format import chat_chunks, sse
from specserve.reasoning_formats import CLOSE, OPEN


def _shell(req, rid: str, created: int, model: str) -> dict:
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
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens_details": {
                "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
        }
    return response


def _text_part(text: str, logprobs: list | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _message_item(text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"id": random_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)] if status == "completed" else []}


class AnswerLogprobs:
    """The log-probabilities of the answer's tokens, the message's (``include:
    ["message.output_text.logprobs"]``), from the chat answer's entries, which cover every
    token: with a reasoning parser the reasoning's are left out, the tokens through the one
    that completes ``</think>`` (``ReasoningParser.reasoning_tokens``' rule, on the entries'
    text). Fed a stream's entries as they come, or a whole answer's at once: the same split."""

    def __init__(self, reasoning=None):
        self.reasoning = reasoning            # the server's ReasoningParser, or None
        self.entries: list[dict] = []
        self.start = None if reasoning is not None else 0     # the answer's first entry, once known
        self.sent = 0                         # entries handed out by ``take``

    def add(self, entries: list[dict]) -> None:
        self.entries += entries
        if self.start is None:
            text = self._text(range(len(self.entries)))
            undecided = not self.reasoning.starts_inside and OPEN.startswith(text)
            if not undecided and (CLOSE in text or not (self.reasoning.starts_inside or text.startswith(OPEN))):
                self.start = self.reasoning.reasoning_tokens(list(range(len(self.entries))), self._text)

    def _text(self, ids) -> str:
        return "".join(self.entries[i]["token"] for i in ids)

    def take(self) -> list[dict]:
        """The answer's entries not handed out yet (none while the reasoning may go on)."""
        if self.start is None:
            return []
        new = self.entries[max(self.start, self.sent):]
        self.sent = len(self.entries)
        return new

    def answer(self) -> list[dict]:
        """All the answer's entries, the output finished (reasoning never closed: none)."""
        if self.start is None:
            self.start = self.reasoning.reasoning_tokens(list(range(len(self.entries))), self._text)
        return self.entries[self.start:]


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": random_id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _call_item(call: dict, status: str = "completed") -> dict:
    function = call["function"]
    return {"id": random_id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": function["name"], "arguments": function.get("arguments") or ""}


def response_body(req, chat: dict, reasoning=None) -> dict:
    """The Response for a chat completion's JSON answer (``req``: the ResponsesRequest;
    ``reasoning``: the server's ReasoningParser, which the logprobs are split by)."""
    choice = chat["choices"][0]
    message = choice["message"]
    logprobs = None
    if choice.get("logprobs") is not None:
        entries = AnswerLogprobs(reasoning)
        entries.add(choice["logprobs"]["content"])
        logprobs = entries.answer()
    output = [_reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    output += [_message_item(message["content"], logprobs=logprobs)] if message.get("content") else []
    output += [_call_item(call) for call in message.get("tool_calls") or []]
    return _finish(_shell(req, random_id("resp"), chat["created"], chat["model"]), output, choice["finish_reason"],
                   chat.get("usage"))


class ResponseEvents:
    """A chat completion's stream (its ``data:`` chunks) -> the Responses API's events."""

    def __init__(self, req, model: str, on_finished=None, reasoning=None, logprobs: bool = False):
        self.response = _shell(req, random_id("resp"), now(), model)
        self.logprobs = AnswerLogprobs(reasoning) if logprobs else None   # asked for: the answer's, by delta
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
        return f"event: {kind}\n" + sse(body)

    def _snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))

    async def translate(self, chunks: AsyncIterator) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._snapshot())
        yield self._event("response.in_progress", response=self._snapshot())
        async with aclosing(chat_chunks(chunks)) as parsed:
            async for chunk in parsed:
                if "error" in chunk:
                    for event in self._failed(chunk["error"]):
                        yield event
                    return
                for event in self._chunk(chunk):
                    yield event
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
            if self.logprobs is not None and choice.get("logprobs"):
                self.logprobs.add(choice["logprobs"]["content"])
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
                                  part=_text_part("", [] if self.logprobs is not None else None))
        self.item_text += piece
        if kind == "reasoning":
            yield self._event("response.reasoning_text.delta", item_id=self.item["id"], output_index=len(self.output),
                              content_index=0, delta=piece)
        else:
            yield self._event("response.output_text.delta", item_id=self.item["id"], output_index=len(self.output),
                              content_index=0, delta=piece,
                              logprobs=self.logprobs.take() if self.logprobs is not None else [])

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
            logprobs = self.logprobs.answer() if self.logprobs is not None else None
            rest = self.logprobs.take() if self.logprobs is not None else []
            if rest:        # tokens that showed no text (the end of sequence): a delta of no text carries them
                yield self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta="", logprobs=rest)
            part = _text_part(self.item_text, logprobs)
            yield self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=self.item_text, logprobs=logprobs or [])
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
