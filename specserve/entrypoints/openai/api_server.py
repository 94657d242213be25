"""An OpenAI-compatible HTTP server over specserve's engine.

    specserve serve --speculative-method ngram --num-speculative-tokens 4 --port 8000

Routes: POST /v1/completions, POST /v1/chat/completions (``stream`` true or
false; server-sent events ``data: {...}`` ending with ``data: [DONE]``),
GET /v1/models, GET /v1/specserve/info (model and speculation), GET /health,
GET /metrics (Prometheus), and the chat page at /. The request extension
``"specserve": {"provenance": true}`` adds how each token came (``provenance.py``).
Requests run on one ``AsyncLLMEngine`` (continuous batching); a client that goes away aborts its
request, which frees its KV blocks. Errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``, in bodies and in streams
alike (``code`` is always a string). What is checked before a request reaches
the engine, and each limit's status code: ``limits.py`` and docs/serving.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError, RequestFailedError
from specserve.entrypoints.openai.chat_page import add_chat_page
from specserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    now,
    random_id,
)
from specserve.entrypoints.openai.limits import OPTIONS as LIMIT_OPTIONS, APIError, ClientGone, ServerLimits, read_json
from specserve.entrypoints.openai.provenance import choice_extension, token_entries
from specserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

_MIN_LOGPROB = -9999.0   # JSON has no -Infinity


# --------------------------------------------------------------------------- errors
def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | int | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    param = ""
    for part in err.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool") or "-" in part:
            break  # a union member's label ("list[int]") or a validator's: the path ends here
        else:
            param += f".{part}" if param else part
    param = param or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field (not part of the API, or not supported)"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code=err.get("type"))


_PARAM_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "stop", "logprobs", "n")


def _sampling_error(e: ValueError) -> APIError:
    """A SamplingParams ValueError as a 400 naming the field its message starts with."""
    message = str(e).removeprefix("invalid SamplingParams: ")
    param = next((n for n in _PARAM_NAMES if message.startswith(n + " ")), None)
    return APIError(400, message, param=param, code="invalid_value")


# -------------------------------------------------------------------------- metrics
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    """Read at scrape time: speculation counts (``engine.spec_stats``) and the KV pool."""

    def __init__(self, async_engine: AsyncLLMEngine, model_name: str):
        self.async_engine = async_engine
        self.model_name = model_name

    def collect(self):
        engine = self.async_engine.engine
        labels, values = ["model_name"], [self.model_name]
        s = engine.spec_stats
        for name, value, doc in (
            ("specserve_spec_decode_num_drafts", s.num_drafts, "Verification steps that carried at least one draft token."),
            ("specserve_spec_decode_num_draft_tokens", s.num_draft_tokens, "Draft tokens proposed."),
            ("specserve_spec_decode_num_accepted_tokens", s.num_accepted_tokens, "Draft tokens accepted by verification."),
            ("specserve_spec_decode_num_emitted_tokens", s.num_emitted_tokens, "Tokens emitted by decode steps (accepted + recovered/bonus)."),
            ("specserve_spec_decode_num_steps", s.num_steps, "Decode (verification) steps, with or without draft tokens."),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c
        g = GaugeMetricFamily("specserve_spec_decode_acceptance_rate", "Accepted / draft tokens since start-up.", labels=labels)
        g.add_metric(values, s.acceptance_rate)
        yield g
        g = GaugeMetricFamily(
            "specserve_spec_decode_mean_acceptance_length",
            "Mean acceptance length (tau): emitted tokens per decode step, bonus included (plain decoding = 1).",
            labels=labels,
        )
        g.add_metric(values, s.mean_acceptance_length)
        yield g
        g = GaugeMetricFamily(
            "specserve_spec_decode_acceptance_by_position", "Acceptance rate of the i-th draft token.", labels=labels + ["position"]
        )
        for i, rate in enumerate(s.acceptance_by_position):
            g.add_metric(values + [str(i)], rate)
        yield g
        g = GaugeMetricFamily("specserve_num_speculative_tokens", "k, draft tokens per step (0: no speculation).", labels=labels)
        g.add_metric(values, engine.num_speculative_tokens)
        yield g
        kv = engine.kv_cache
        g = GaugeMetricFamily("specserve_kv_cache_free_blocks", "Free KV-cache blocks.", labels=labels)
        g.add_metric(values, kv.num_free_blocks)
        yield g
        g = GaugeMetricFamily("specserve_kv_cache_total_blocks", "KV-cache blocks in the pool.", labels=labels)
        g.add_metric(values, kv.num_blocks)
        yield g
        g = GaugeMetricFamily("specserve_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", labels=labels)
        g.add_metric(values, 1.0 - kv.num_free_blocks / kv.num_blocks)
        yield g
        for name, value, doc in (
            ("specserve_prefix_cache_queries", kv.num_queried_tokens, "Prompt tokens looked up in the prefix cache."),
            ("specserve_prefix_cache_hits", kv.num_hit_tokens, "Prompt tokens found in the prefix cache (not recomputed)."),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c


class ServerMetrics:
    def __init__(self, async_engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        r, ln = self.registry, ["model_name"]
        self.model_name = model_name
        self.requests = Counter("specserve_requests", "Requests accepted.", ln + ["endpoint"], registry=r)
        self.finished = Counter("specserve_request_success", "Finished completions (choices), by finish reason.", ln + ["finish_reason"], registry=r)
        self.errors = Counter("specserve_request_errors", "Requests answered with an error, by HTTP status.", ln + ["status"], registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of accepted requests.", ln, registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Generated tokens.", ln, registry=r)
        self.running = Gauge("specserve_num_requests_running", "Completions in flight on this server.", ln, registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time from arrival to the first token.", ln, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "specserve_time_per_output_token_seconds", "Per request: (finish - first token) / (output tokens - 1).", ln, buckets=TPOT_BUCKETS, registry=r
        )
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Time from arrival to the last token.", ln, buckets=E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(async_engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------------- one choice
def _clean_logprob(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


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


class _Choice:
    """Streaming state of one choice: what was sent, timings for the metrics."""

    def __init__(self, index: int, stops: list[str], arrival: float, counts_prompt: bool = True):
        self.index = index
        self.counts_prompt = counts_prompt   # the first sample of its prompt (usage counts a prompt once)
        self.stops = stops
        self.arrival = arrival
        self.sent_text = ""
        self.num_tokens_sent = 0
        self.first_token_time: float | None = None
        self.output: RequestOutput | None = None

    def update(self, out: RequestOutput) -> None:
        self.output = out
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


def _completion_logprobs(tokenizer, completion, start: int, end: int, num_top: int, text_offset: int) -> dict | None:
    if completion.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        chosen = entry[tid]
        tok = chosen.decoded_token if chosen.decoded_token is not None else tokenizer.decode([tid])
        tokens.append(tok)
        token_lps.append(_clean_logprob(chosen.logprob))
        offsets.append(text_offset)
        text_offset += len(tok)
        if num_top:
            ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top), key=lambda lp: lp.rank)
            tops.append({lp.decoded_token: _clean_logprob(lp.logprob) for lp in ranked})
        else:
            tops.append(None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tokenizer, completion, start: int, end: int, num_top: int) -> dict | None:
    if completion.logprobs is None:
        return None
    content = []
    for tid, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        chosen = entry[tid]
        tok = chosen.decoded_token if chosen.decoded_token is not None else tokenizer.decode([tid])
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append(
            {
                "token": tok,
                "logprob": _clean_logprob(chosen.logprob),
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": lp.decoded_token, "logprob": _clean_logprob(lp.logprob), "bytes": list((lp.decoded_token or "").encode("utf-8"))}
                    for lp in ranked
                ],
            }
        )
    return {"content": content}


def _usage(choices: list[_Choice]) -> dict:
    prompt = sum(len(c.output.prompt_token_ids) for c in choices if c.output is not None and c.counts_prompt)
    completion = sum(len(c.output.outputs[0].token_ids) for c in choices if c.output is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator and then calls
    ``on_close``, so an early end (client gone, even before the first chunk;
    server shutting down) aborts the requests at once, not at garbage collection."""

    def __init__(self, *args, on_close=None, **kwargs):
        super().__init__(*args, **kwargs)
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


# -------------------------------------------------------------------------- serving
class OpenAIServing:
    def __init__(self, async_engine: AsyncLLMEngine, served_model_names: list[str], limits: ServerLimits | None = None):
        self.async_engine = async_engine
        self.limits = limits or ServerLimits()
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.metrics = ServerMetrics(async_engine, self.model_name)

    # ------------------------------------------------------------------ helpers
    def info(self) -> dict:
        """``GET /v1/specserve/info``: the served model and how it speculates (the chat page shows it)."""
        engine = self.engine
        spec = engine.spec_config
        speculative = None if spec is None else {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_model": spec.model,
            "dynamic_k": bool(spec.dynamic_k),
        }
        return {"model": self.model_name, "max_model_len": engine.max_model_len, "speculative": speculative}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.served_model_names}",
                param="model",
                code="model_not_found",
            )

    def chat_prompt(self, request: ChatCompletionRequest) -> str:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, f"the model {self.model_name!r} has no chat template; use /v1/completions", param="messages")
        conversation = [m.to_template_dict() for m in request.messages]
        try:
            return tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=request.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    async def start(self, prompts: list[str | list[int]], params, param_name: str) -> list:
        """Queue every prompt; if one is rejected, abort the ones already queued."""
        streams = []
        try:
            for p in prompts:
                streams.append(await self.async_engine.add_request(p, params))
        except ValueError as e:
            for s in streams:
                self.async_engine.abort(s.request_id)
            raise APIError(400, str(e), param=param_name, code="invalid_prompt") from None
        except BaseException:
            for s in streams:
                self.async_engine.abort(s.request_id)
            raise
        return streams

    async def merged(self, streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from several requests as they come; aborts all when left early."""
        if len(streams) == 1:
            async for out in self.async_engine.iterate(streams[0]):
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in self.async_engine.iterate(stream):
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
                    self.async_engine.abort(s.request_id)

    async def choice_outputs(self, streams: list, n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, that choice's output) as they change: each request carries n samples,
        choice ``n * prompt + sample``, as OpenAI numbers them; each output holds one completion
        and is finished when that completion is."""
        if n == 1:
            async for i, out in self.merged(streams):
                yield i, out
            return
        seen: dict[int, tuple[int, str | None]] = {}
        async for i, out in self.merged(streams):
            for j, completion in enumerate(out.outputs):
                index, state = i * n + j, (len(completion.token_ids), completion.finish_reason)
                if seen.get(index) == state:
                    continue
                seen[index] = state
                yield index, dataclasses.replace(out, outputs=[completion],
                                                 finished=completion.finish_reason is not None)

    def record_finish(self, choice: _Choice) -> None:
        out, m, ln = choice.output, self.metrics, self.model_name
        if out is None:
            return
        completion = out.outputs[0]
        n = len(completion.token_ids)
        finish = time.monotonic()
        m.finished.labels(ln, completion.finish_reason or "abort").inc()
        m.generation_tokens.labels(ln).inc(n)
        m.e2e.labels(ln).observe(finish - choice.arrival)
        if choice.first_token_time is not None:
            m.ttft.labels(ln).observe(choice.first_token_time - choice.arrival)
            if n > 1:
                m.tpot.labels(ln).observe((finish - choice.first_token_time) / (n - 1))

    async def collect(self, streams: list, choices: list[_Choice], raw: Request, n: int = 1) -> bool:
        """Run to completion (non-streaming); False (and abort) if the client disconnects meanwhile."""

        async def consume():
            async for i, out in self.choice_outputs(streams, n):
                choices[i].update(out)
                if out.finished:
                    self.record_finish(choices[i])

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

    # --------------------------------------------------------------- endpoints
    def sampling_params(self, request):
        """The request's SamplingParams, checked against this model (vocabulary-sized fields)."""
        try:
            params = request.to_sampling_params()
        except ValueError as e:
            raise _sampling_error(e) from None
        vocab = self.engine.vocab_size
        if params.top_k > vocab:
            raise APIError(400, f"top_k must be at most the vocabulary size {vocab} (or -1/0: off), got {params.top_k}",
                           param="top_k", code="invalid_value")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or {}))):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise APIError(400, f"{name} token ids out of range [0, {vocab}): {bad[:5]}", param=name,
                               code="invalid_value")
        return params

    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        self.check_model(request.model)
        arrival = time.monotonic()
        params = self.sampling_params(request)
        prompts = request.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise APIError(400, f"at most {self.limits.max_prompts} prompts per request, got {len(prompts)}",
                           param="prompt", code="too_many_prompts")
        streams = await self.start(prompts, params, "prompt")
        return await self._respond(request, raw, streams, params, arrival, chat=False)

    async def chat_completions(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(request.model)
        arrival = time.monotonic()
        params = self.sampling_params(request)
        prompt = await self.async_engine.run_off_thread(self.chat_prompt, request)
        streams = await self.start([prompt], params, "messages")
        return await self._respond(request, raw, streams, params, arrival, chat=True)

    async def _respond(self, request, raw: Request, streams, params, arrival: float, chat: bool) -> Response:
        m, ln = self.metrics, self.model_name
        m.requests.labels(ln, "chat" if chat else "completions").inc()
        n = params.n
        choices = [_Choice(i, list(params.stop), arrival, counts_prompt=i % n == 0) for i in range(len(streams) * n)]
        if request.stream:
            def abort_unfinished():
                for s in streams:
                    if not s.finished:
                        self.async_engine.abort(s.request_id)

            return _SSEResponse(self._stream(request, streams, choices, params, chat, n), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, on_close=abort_unfinished)
        m.running.labels(ln).inc(len(streams))
        try:
            completed = await self.collect(streams, choices, raw, n)
        finally:
            m.running.labels(ln).dec(len(streams))
        if not completed:  # nobody to answer: the requests were aborted
            m.finished.labels(ln, "abort").inc(len(streams))
            return Response(status_code=499)
        for c in choices:
            if c.counts_prompt:
                m.prompt_tokens.labels(ln).inc(len(c.output.prompt_token_ids))
        created, rid = now(), random_id("chatcmpl" if chat else "cmpl")
        body_choices = []
        num_top = params.logprobs or 0
        for c in choices:
            completion = c.output.outputs[0]
            n = len(completion.token_ids)
            if chat:
                choice = {
                    "index": c.index,
                    "message": {"role": "assistant", "content": completion.text},
                    "logprobs": _chat_logprobs(self.tokenizer, completion, 0, n, num_top),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            else:
                choice = {
                    "index": c.index,
                    "text": completion.text,
                    "logprobs": _completion_logprobs(self.tokenizer, completion, 0, n, num_top, 0),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            if request.wants_provenance:
                tokens = token_entries(self.tokenizer, completion, 0, n, params.skip_special_tokens)
                choice["specserve"] = choice_extension(tokens, completion)
            body_choices.append(choice)
        return JSONResponse({
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": body_choices,
            "usage": _usage(choices),
        })

    async def _stream(self, request, streams, choices: list[_Choice], params, chat: bool, n: int = 1) -> AsyncIterator[str]:
        m, ln = self.metrics, self.model_name
        created, rid = now(), random_id("chatcmpl" if chat else "cmpl")
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = request.include_usage
        num_top = params.logprobs or 0
        provenance = request.wants_provenance
        offsets = [0] * len(choices)
        counted_prompt = [False] * len(choices)

        def chunk(choice_list: list[dict], usage: Any = None, with_usage: bool = False) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choice_list}
            if include_usage:
                body["usage"] = usage if with_usage else None
            return _sse(body)

        m.running.labels(ln).inc(len(streams))
        try:
            if chat:
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            async for i, out in self.choice_outputs(streams, n):
                c = choices[i]
                c.update(out)
                if not counted_prompt[i] and c.counts_prompt:
                    counted_prompt[i] = True
                    m.prompt_tokens.labels(ln).inc(len(out.prompt_token_ids))
                step = c.next_delta()
                if step is None:
                    continue
                delta, start, end = step
                completion = out.outputs[0]
                finish = completion.finish_reason if out.finished else None
                tokens = (token_entries(self.tokenizer, completion, start, end, params.skip_special_tokens)
                          if provenance else None)
                if chat:
                    if delta or (start < end and (completion.logprobs is not None or provenance)):
                        choice = {
                            "index": c.index,
                            "delta": {"content": delta},
                            "logprobs": _chat_logprobs(self.tokenizer, completion, start, end, num_top),
                            "finish_reason": None,
                        }
                        if provenance:
                            choice["specserve"] = choice_extension(tokens)
                            tokens = []
                        yield chunk([choice])
                    if finish is not None:
                        choice = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                                  "stop_reason": completion.stop_reason}
                        if provenance:
                            choice["specserve"] = choice_extension(tokens, completion)
                        yield chunk([choice])
                else:
                    lp = _completion_logprobs(self.tokenizer, completion, start, end, num_top, offsets[i])
                    offsets[i] += len(delta)
                    choice = {"index": c.index, "text": delta, "logprobs": lp, "finish_reason": finish}
                    if finish is not None:
                        choice["stop_reason"] = completion.stop_reason
                    if provenance:
                        choice["specserve"] = choice_extension(tokens, completion if finish is not None else None)
                    yield chunk([choice])
                if out.finished:
                    self.record_finish(c)
            if include_usage:
                yield chunk([], _usage(choices), with_usage=True)
        except (EngineStepError, EngineDeadError, RequestFailedError) as e:
            err = _engine_error(e)
            m.errors.labels(ln, str(err.status)).inc()
            yield _sse(error_body(err.message, err.type, err.param, err.code))
        finally:
            m.running.labels(ln).dec(len(streams))
            for c in choices:  # left early (client gone): those requests were aborted
                if c.output is None or not c.output.finished:
                    m.finished.labels(ln, "abort").inc()
        yield "data: [DONE]\n\n"


def _engine_error(e: Exception) -> APIError:
    """The one error shape of an engine failure, in a body or in a stream."""
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", code="engine_dead")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), "server_error", code="request_failed")
    return APIError(500, str(e), "server_error", code="engine_error")


# ------------------------------------------------------------------------------ app
class _APIKeyMiddleware:
    """401 for /v1/* without ``Authorization: Bearer <key>`` (pure ASGI: streaming-safe)."""

    def __init__(self, app, api_key: str, on_reject=None):
        self.app = app
        self.api_key = api_key.encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                if self.on_reject is not None:
                    self.on_reject()
                message = "missing API key (send 'Authorization: Bearer <key>')" if not auth else "invalid API key"
                response = error_response(401, message, "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(llm_or_engine, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app over an ``LLM``, ``LLMEngine`` or ``AsyncLLMEngine``.

    Apps built over the same engine share one engine loop (one step at a time).
    ``served_model_name``: the name (or names) requests may use in ``model``;
    default: the engine's model name. ``limits``: body size, read time, JSON
    depth, prompts per request (default: ``ServerLimits.from_env()``).
    """
    async_engine = AsyncLLMEngine.from_engine(llm_or_engine)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if not names:
        names = [async_engine.engine.model_name]
    limits = limits if limits is not None else ServerLimits.from_env()
    serving = OpenAIServing(async_engine, names, limits)
    m, ln = serving.metrics, serving.model_name

    app = FastAPI(title="specserve OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.async_engine = async_engine
    app.state.limits = limits                 # uvicorn_config() reads the header limits from here

    def fail(e: APIError) -> JSONResponse:
        m.errors.labels(ln, str(e.status)).inc()
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
            raise _validation_error(e) from None

    async def handle(raw: Request, model_cls, endpoint) -> Response:
        try:
            request = await parse(raw, model_cls)
            return await endpoint(request, raw)
        except APIError as e:
            return fail(e)
        except ClientGone:  # disconnected mid-upload: nobody to answer, nothing to log
            m.errors.labels(ln, "499").inc()
            return Response(status_code=499)
        except (EngineDeadError, EngineStepError, RequestFailedError) as e:
            return fail(_engine_error(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never crash the server on one request
            logger.exception("request failed")
            return fail(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error", code="internal_error"))

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await handle(raw, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await handle(raw, ChatCompletionRequest, serving.chat_completions)

    @app.get("/v1/models")
    async def models():
        engine = async_engine.engine
        cards = [ModelCard(id=n, root=engine.model_name, max_model_len=engine.max_model_len) for n in names]
        return JSONResponse(ModelList(data=cards).model_dump())

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
    return app


def run_server(args) -> int:
    """``specserve serve``: build the engine, then serve until interrupted."""
    import os

    import uvicorn

    from specserve.entrypoints.cli import build_llm
    from specserve.entrypoints.openai.connection import uvicorn_config

    api_key = args.api_key or os.environ.get("SPECSERVE_API_KEY") or None
    limits = ServerLimits.from_env(**{o.field: getattr(args, o.field, None) for o in LIMIT_OPTIONS})
    llm = build_llm(args)
    engine = llm.engine
    names = list(args.served_model_name or []) or [engine.model_name]
    if args.model and args.model not in names:
        names.append(args.model)
    app = build_app(llm, names, api_key=api_key, limits=limits)
    async_engine = app.state.async_engine
    async_engine.start()
    spec = engine.spec_config
    logger.info(
        "serving %s on http://%s:%d (speculation: %s)", names[0], args.host, args.port,
        f"{spec.method}, k={spec.num_speculative_tokens}" if spec else "off",
    )
    try:
        uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level)).run()
    finally:
        async_engine.shutdown(timeout=5)
    return 0
