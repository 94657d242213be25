"""A completion's requests on the engine: queue them, merge their outputs, fan out samples, collect.

One HTTP request may carry several prompts (one engine request each) and ``n``
samples per prompt; these functions turn the engine's per-request streams into
``(choice index, output)`` pairs numbered as OpenAI numbers choices, and abort
whatever is left unfinished when the caller stops listening.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import AsyncIterator, Callable

from fastapi import Request

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.entrypoints.openai.limits import APIError
from specserve.entrypoints.openai.response_format import ChoiceState
from specserve.lora.peft_adapter import LoraAdapterError
from specserve.outputs import RequestOutput


# Each queued request, at INFO, where ``serve --enable-log-requests`` turns it on (vLLM's flag):
# its settings, never its text.
REQUEST_LOG = logging.getLogger("specserve.requests")


async def start_requests(async_engine: AsyncLLMEngine, prompts: list[str | list[int]], params, param_name: str,
                         priority: int = 0, endpoint: str = "", lora_request=None) -> list:
    """Queue every prompt (at ``priority``; a beam search has none; with ``lora_request``'s adapter); if
    one is rejected, abort the ones already queued (an adapter that cannot run: a 400 naming ``model``)."""
    streams = []
    try:
        for p in prompts:
            streams.append(await async_engine.add_request(p, params, priority=priority, lora_request=lora_request))
            if REQUEST_LOG.isEnabledFor(logging.INFO):
                REQUEST_LOG.info("request %s (%s): prompt of %d %s, priority %d, %s%s", streams[-1].request_id,
                                 endpoint or param_name, len(p), "characters" if isinstance(p, str) else "tokens",
                                 priority, _settings(params),
                                 f", LoRA {lora_request.lora_name!r}" if lora_request is not None else "")
    except LoraAdapterError as e:
        for s in streams:
            async_engine.abort(s.request_id)
        raise APIError(400, str(e), param="model", code="invalid_value") from None
    except ValueError as e:
        for s in streams:
            async_engine.abort(s.request_id)
        raise APIError(400, str(e), param=param_name, code="invalid_prompt") from None
    except BaseException:
        for s in streams:
            async_engine.abort(s.request_id)
        raise
    return streams


def _settings(params) -> str:
    """The sampling settings worth a log line (SamplingParams or BeamSearchParams)."""
    names = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "beam_width")
    return ", ".join(f"{n}={getattr(params, n)!r}" for n in names if getattr(params, n, None) is not None)


async def merged(async_engine: AsyncLLMEngine, streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several requests as they come; aborts all when left early."""
    if len(streams) == 1:
        async for out in async_engine.iterate(streams[0]):
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in async_engine.iterate(stream):
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001
            q.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            if not s.finished:
                async_engine.abort(s.request_id)


async def choice_outputs(async_engine: AsyncLLMEngine, streams: list, n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, that choice's output) as they change: each request carries n samples,
    choice ``n * prompt + sample``, as OpenAI numbers them; each output holds one completion
    and is finished when that completion is. A beam search (one output, when done) holds its
    beams best first: the first n are the choices."""
    if n == 1:
        async for i, out in merged(async_engine, streams):
            yield i, out
        return
    seen: dict[int, tuple[int, str | None]] = {}
    async for i, out in merged(async_engine, streams):
        for j, completion in enumerate(out.outputs[:n]):    # a beam search returns its n best beams
            index, state = i * n + j, (len(completion.token_ids), completion.finish_reason)
            if seen.get(index) == state:
                continue
            seen[index] = state
            yield index, dataclasses.replace(out, outputs=[completion],
                                             finished=completion.finish_reason is not None)


async def collect(async_engine: AsyncLLMEngine, streams: list, choices: list[ChoiceState], raw: Request,
                  record_finish: Callable[[ChoiceState], None], n: int = 1) -> bool:
    """Run to completion (non-streaming), ``record_finish`` on each finished choice;
    False (and abort) if the client disconnects meanwhile."""

    async def consume():
        async for i, out in choice_outputs(async_engine, streams, n):
            choices[i].update(out)
            if out.finished:
                record_finish(choices[i])

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                task.result()
                return True
            if await raw.is_disconnected():
                task.cancel()
                return False
    finally:
        if not task.done():
            task.cancel()
