"""A chat completion's answer as an Anthropic Messages API message, and its stream as Anthropic's
events (``anthropic_messages.py`` rewrites the request; this module the answer).

``message_body``: the chat answer's reasoning (with a reasoning parser), text and tool calls as
``thinking``, ``text`` and ``tool_use`` content blocks; ``stop_reason`` ``end_turn``,
``max_tokens``, ``stop_sequence`` (with the ``stop_sequence`` matched) or ``tool_use``; ``usage``
in Anthropic's names (``cache_read_input_tokens``: the prompt tokens the prefix cache held).
``MessageEvents``: the chat stream's ``data:`` chunks read as they come: ``message_start``, each
block opened (``content_block_start``), filled (``content_block_delta``: ``thinking_delta``,
``text_delta``, ``input_json_delta``) and closed (``content_block_stop``), then
``message_delta`` (the stop reason and output tokens) and ``message_stop``; an engine failure
is an ``error`` event.
"""
from __future__ import annotations

import json
from contextlib import aclosing
from typing import AsyncIterator

from specserve.entrypoints.openai.protocol import random_id
from specserve.entrypoints.openai.response_format import chat_chunks, sse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop(finish_reason: str | None, stop_reason, stop_sequences: list[str]) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence matched or None) of a chat choice's end."""
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "cache_creation_input_tokens": 0}


def _tool_input(arguments: str | None) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(chat: dict, stop_sequences: list[str]) -> dict:
    """The Message for a chat completion's JSON answer."""
    choice = chat["choices"][0]
    message = choice["message"]
    content = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"].get("arguments"))})
    stop_reason, stop_sequence = _stop(choice["finish_reason"], choice.get("stop_reason"), stop_sequences)
    return {"id": random_id("msg"), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(chat.get("usage"))}


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\n" + sse({"type": kind, **fields})


class MessageEvents:
    """A chat completion's stream (its ``data:`` chunks) -> Anthropic's Messages events."""

    def __init__(self, model: str, stop_sequences: list[str] | None = None):
        self.model = model
        self.stop_sequences = stop_sequences or []
        self.started = False
        self.index = -1                 # the open block's index
        self.kind: str | None = None    # the open block's type: thinking, text or tool_use
        self.finish = (None, None)      # the chat choice's (finish_reason, stop_reason)
        self.usage: dict | None = None

    async def translate(self, chunks: AsyncIterator) -> AsyncIterator[str]:
        async with aclosing(chat_chunks(chunks)) as parsed:
            async for chunk in parsed:
                if "error" in chunk:
                    yield _event("error", error={"type": "api_error", "message": chunk["error"].get("message", "")})
                    return
                for event in self._chunk(chunk):
                    yield event
        for event in self._start():
            yield event
        for event in self._close():
            yield event
        stop_reason, stop_sequence = _stop(*self.finish, self.stop_sequences)
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage={"output_tokens": (self.usage or {}).get("completion_tokens", 0)})
        yield _event("message_stop")

    def _start(self):
        if not self.started:
            self.started = True
            usage = _usage(self.usage)
            usage["output_tokens"] = 0
            yield _event("message_start", message={
                "id": random_id("msg"), "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage})

    def _chunk(self, chunk: dict):
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content") or delta.get("content") or delta.get("tool_calls"):
                yield from self._start()      # after the role's chunk: the usage has the prompt's tokens by now
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._block("thinking", {"thinking": "", "signature": ""})
                yield self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                yield from self._block("text", {"text": ""})
                yield self._delta({"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):                 # a new call: its name first, then its arguments
                    yield from self._close()
                    yield from self._block("tool_use", {"id": call["id"], "name": function.get("name", ""), "input": {}})
                if function.get("arguments") and self.kind == "tool_use":
                    yield self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
            if choice.get("finish_reason"):
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))

    def _block(self, kind: str, fields: dict):
        """Open a block of ``kind`` unless one is open already (a tool_use block: always a new one)."""
        if self.kind == kind and kind != "tool_use":
            return
        yield from self._close()
        self.index += 1
        self.kind = kind
        yield _event("content_block_start", index=self.index, content_block={"type": kind, **fields})

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)

    def _close(self):
        if self.kind is not None:
            yield _event("content_block_stop", index=self.index)
            self.kind = None
