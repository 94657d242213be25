"""The pieces of a completion response: one choice's streaming state and its JSON parts.

``ChoiceState`` tracks what a choice has sent (``hold_back`` keeps back a partial
UTF-8 character or a possible stop string's start); ``completion_logprobs`` and
``chat_logprobs`` are OpenAI's two logprobs shapes; ``usage`` counts tokens;
``sse`` is one server-sent event and ``SSEResponse`` a stream that always
cleans up after itself.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from specserve.outputs import RequestOutput


MIN_LOGPROB = -9999.0   # JSON has no -Infinity


def clean_logprob(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def without_tokens(out: RequestOutput) -> RequestOutput:
    """``out`` with its completion emptied (echo with max_tokens 0 answers the prompt alone; the
    engine sampled one token, which is dropped): finish_reason "length" once finished."""
    c = out.outputs[0]
    finish = "length" if c.finish_reason in ("stop", "length") else c.finish_reason
    empty = dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                token_sources=[], finish_reason=finish, stop_reason=None)
    return dataclasses.replace(out, outputs=[empty])


def hold_back(text: str, stops: list[str]) -> str:
    """The part of unfinished text that is safe to send: no trailing U+FFFD (a
    partial UTF-8 character) and no tail that could be the start of a stop string."""
    text = text.rstrip("\ufffd")
    cut = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), cut, -1):
            if text.endswith(stop[:k]):
                cut = k
                break
    return text[: len(text) - cut] if cut else text


class ChoiceState:
    """Streaming state of one choice: what was sent, timings for the metrics."""

    def __init__(self, index: int, stops: list[str], arrival: float, counts_prompt: bool = True,
                 prompt_only: bool = False):
        self.index = index
        self.prompt_only = prompt_only      # echo with max_tokens 0: the sampled token is left out
        self.counts_prompt = counts_prompt   # the first sample of its prompt (usage counts a prompt once)
        self.stops = stops
        self.arrival = arrival
        self.sent_text = ""
        self.num_tokens_sent = 0
        self.first_token_time: float | None = None
        self.output: RequestOutput | None = None

    def update(self, out: RequestOutput) -> None:
        self.output = without_tokens(out) if self.prompt_only else out
        if self.first_token_time is None and out.outputs[0].token_ids:
            self.first_token_time = time.monotonic()

    def next_delta(self) -> tuple[str, int, int] | None:
        """(text delta, first token index, end token index) to send now, or None."""
        out = self.output
        completion = out.outputs[0]
        text = completion.text if out.finished else hold_back(completion.text, self.stops)
        delta = text[len(self.sent_text):] if len(text) > len(self.sent_text) else ""
        if not delta and not out.finished:
            return None
        self.sent_text += delta
        start, end = self.num_tokens_sent, len(completion.token_ids)
        self.num_tokens_sent = end
        return delta, start, end


def completion_logprobs(tokenizer, completion, start: int, end: int, num_top: int | None,
                        text_offset: int) -> dict | None:
    """Tokens start..end in /v1/completions' shape; None where the request asked for no logprobs
    (``num_top`` None), even if the output carries them (a beam's own log-probabilities)."""
    if num_top is None or completion.logprobs is None:
        return None
    return completion_shape(tokenizer, zip(completion.token_ids[start:end], completion.logprobs[start:end]), num_top,
                            text_offset)


def completion_shape(tokenizer, entries, num_top: int, text_offset: int) -> dict:
    """(token id, {token id: Logprob} or None) pairs -> /v1/completions' logprobs: tokens,
    token_logprobs, top_logprobs (the top ``num_top``; null for 0) and text_offset (from
    ``text_offset``). A None entry (a prompt's first token) gives null logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in entries:
        chosen = None if entry is None else entry[tid]
        tok = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else tokenizer.decode([tid])
        tokens.append(tok)
        token_lps.append(None if chosen is None else clean_logprob(chosen.logprob))
        offsets.append(text_offset)
        text_offset += len(tok)
        if num_top and entry is not None:
            ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top), key=lambda lp: lp.rank)
            tops.append({lp.decoded_token: clean_logprob(lp.logprob) for lp in ranked})
        else:
            tops.append(None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, completion, start: int, end: int, num_top: int | None) -> dict | None:
    """Tokens start..end in chat's shape; None where the request asked for no logprobs."""
    if num_top is None or completion.logprobs is None:
        return None
    content = []
    for tid, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        chosen = entry[tid]
        tok = chosen.decoded_token if chosen.decoded_token is not None else tokenizer.decode([tid])
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append(
            {
                "token": tok,
                "logprob": clean_logprob(chosen.logprob),
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": lp.decoded_token, "logprob": clean_logprob(lp.logprob), "bytes": list((lp.decoded_token or "").encode("utf-8"))}
                    for lp in ranked
                ],
            }
        )
    return {"content": content}


def usage(choices: list[ChoiceState]) -> dict:
    """OpenAI's usage, with ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix
    cache held, not computed again."""
    counted = [c.output for c in choices if c.output is not None and c.counts_prompt]
    prompt = sum(len(o.prompt_token_ids) for o in counted)
    cached = sum(o.metrics.get("num_cached_tokens", 0) for o in counted)
    completion = sum(len(c.output.outputs[0].token_ids) for c in choices if c.output is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def chat_chunks(chunks: AsyncIterator) -> AsyncIterator[dict]:
    """A chat completion stream's ``data:`` chunks, parsed, in order (an ``{"error": ...}`` chunk
    too), for the handlers that answer in another API's events (Responses, Anthropic's). Read it
    under ``contextlib.aclosing``: the chat stream is closed when the reader stops, early or not."""
    try:
        async for raw in chunks:
            text = raw.decode() if isinstance(raw, bytes) else raw
            for line in text.split("\n"):
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: "):])
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """A stream of server-sent events (uncached, unbuffered by proxies) that always closes its
    generator and then calls ``on_close``, so an early end (client gone, even before the first
    chunk; server shutting down) aborts the requests at once, not at garbage collection."""

    def __init__(self, content, on_close=None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except BaseException:  # noqa: BLE001 - best effort while unwinding
                    pass
            if self.on_close is not None:
                self.on_close()
