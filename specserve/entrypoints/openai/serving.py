"""The completions and chat handlers: a checked request in, a JSON body or a stream of events out.

``OpenAIServing`` checks what the engine cannot (the model name, the chat template,
vocabulary-sized fields, prompts per request), queues the prompts
(``request_streams.py``) and answers with one body or, for ``stream`` true,
server-sent events ``data: {...}`` ending with ``data: [DONE]``; it records the
server's metrics (``metrics.py``) as the choices finish. An engine failure in a
stream becomes one error event (``errors.py``) before ``[DONE]``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from specserve.beam_search_params import BeamSearchParams
from specserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError, RequestFailedError
from specserve.engine.beam_groups import beam_capable_proposer
from specserve.engine.input_checks import check_priority
from specserve.entrypoints.chat_template import ChatTemplateError, render_chat
from specserve.entrypoints.fill_in_middle import fim_params, fim_prompt
from specserve.entrypoints.openai import structured, tool_calls
from specserve.entrypoints.openai.echo import echo_logprobs, joined, prompt_logprobs_json, prompt_text
from specserve.entrypoints.openai.tool_call_stream import ToolCallStream, parse_whole
from specserve.entrypoints.openai.errors import engine_error, error_body, sampling_error
from specserve.entrypoints.openai.limits import APIError, ServerLimits
from specserve.entrypoints.openai.lora_modules import LlamaLoras, LoraModules
from specserve.entrypoints.openai.metrics import ServerMetrics
from specserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
    random_id,
)
from specserve.entrypoints.openai.provenance import choice_extension, token_entries
from specserve.entrypoints.openai.reasoning import ReasoningParser
from specserve.entrypoints.openai.request_streams import choice_outputs, collect, start_requests
from specserve.entrypoints.openai.response_format import (
    ChoiceState,
    SSEResponse,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage,
)
from specserve.lora.request import LoRAMix, LoRARequest


class OpenAIServing:
    """The handlers of one app over one engine (``build_app`` makes one per app)."""

    def __init__(self, async_engine: AsyncLLMEngine, served_model_names: list[str], limits: ServerLimits | None = None,
                 reasoning: ReasoningParser | None = None):
        """``self.loras``: the LoRA adapters requests may name in ``model`` (``lora_modules.py``; build_app adds them)."""
        self.async_engine = async_engine
        self.reasoning = reasoning          # chat answers' reasoning split from their content (reasoning.py)
        self.limits = limits or ServerLimits()
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.loras = LoraModules(served_model_names)
        self.llama_loras = LlamaLoras([])      # llama-server's --lora files (build_app sets them)
        self.metrics = ServerMetrics(async_engine, self.model_name)

    def _usage(self, choices, params) -> dict:
        """``usage(choices)``, with ``completion_tokens_details.reasoning_tokens`` when a reasoning
        parser splits the answers (OpenAI's field: the tokens of the reasoning)."""
        counts = usage(choices)
        if self.reasoning is not None:
            def decode(ids):
                return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

            counts["completion_tokens_details"] = {"reasoning_tokens": sum(
                self.reasoning.reasoning_tokens(list(c.output.outputs[0].token_ids), decode)
                for c in choices if c.output is not None)}
        return counts

    # ------------------------------------------------------- model facts, checks
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

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); a 404 for a name this server has not."""
        lora = self.loras.get(model)
        if model is not None and lora is None and model not in self.served_model_names:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.served_model_names + list(self.loras.by_name)}",
                param="model",
                code="model_not_found",
            )
        return lora

    def request_lora(self, request, mix: LoRAMix | None = None) -> LoRARequest | LoRAMix | None:
        """A request's adapter: the one its ``model`` names; else ``mix`` (a llama-server request's own
        ``lora`` list), else llama-server's --lora files at their global scales; else none."""
        lora = self.check_model(request.model)
        if lora is not None:
            return lora
        return mix if mix is not None else self.llama_loras.mix()

    def answer_model(self, request) -> str:
        """The name an answer carries: the LoRA adapter's when the request named one (vLLM's)."""
        return request.model if self.loras.get(getattr(request, "model", None)) is not None else self.model_name

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        """The conversation rendered by the chat template (``entrypoints/chat_template.py``) and
        tokenized as it is (the template wrote the special tokens, so the tokenizer adds none)."""
        tok = self.tokenizer
        conversation, tools = tool_calls.conversation(request, tok)
        try:
            text = render_chat(tok, conversation, request.add_generation_prompt, request.continue_final_message, tools,
                               request.template_kwargs(), self.model_name)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param=e.param) from None
        return self.engine.tokenize(text, add_special_tokens=False)

    async def tokenize(self, request: TokenizeRequest, raw: Request) -> Response:
        """vLLM's /tokenize: the ids a generation endpoint would compute for this prompt or
        conversation, their count and the context length."""
        self.check_model(request.model)
        if request.messages is not None:
            ids = await self.async_engine.run_off_thread(self.chat_prompt, request.as_chat())
        else:
            ids = await self.async_engine.run_off_thread(self.engine.tokenize, request.prompt,
                                                         request.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids})

    async def detokenize(self, request: DetokenizeRequest, raw: Request) -> Response:
        """vLLM's /detokenize: token ids -> their text."""
        self.check_model(request.model)
        vocab = self.engine.vocab_size
        bad = [t for t in request.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens",
                           code="invalid_value")
        text = await self.async_engine.run_off_thread(self.tokenizer.decode, request.tokens)
        return JSONResponse({"prompt": text})

    # --------------------------------------------------------------- endpoints
    def sampling_params(self, request):
        """The request's SamplingParams (the model's defaults where it sets no value), checked against
        this model (vocabulary-sized fields)."""
        try:
            params = request.to_sampling_params(self.engine.sampling_defaults)
        except ValueError as e:
            raise sampling_error(e) from None
        try:
            check_priority(request.priority, self.engine.config.scheduling_policy)
        except ValueError as e:
            raise APIError(400, str(e), param="priority", code="invalid_value") from None
        vocab = self.engine.vocab_size
        if params.top_k > vocab:
            raise APIError(400, f"top_k must be at most the vocabulary size {vocab} (or -1/0: off), got {params.top_k}",
                           param="top_k", code="invalid_value")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or {})),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise APIError(400, f"{name} token ids out of range [0, {vocab}): {bad[:5]}", param=name,
                               code="invalid_value")
        return params

    async def constrained(self, request, params):
        """``params`` with the request's structured-output constraint (its fields, or for chat
        tool_choice "required" / a named function), compiled and checked: a 400 here, before
        the request reaches the engine (``structured.py``)."""
        so, field = structured.requested(request)
        tool_so = tool_calls.constraint(request) if isinstance(request, ChatCompletionRequest) else None
        if tool_so is not None:
            if so is not None:
                raise APIError(400, f"tool_choice {request.tool_choice!r} constrains the output already; it cannot be "
                                    f"combined with {field}", param=field, code="invalid_value")
            so, field = tool_so, "tool_choice"
        if so is None:
            return params
        if self.reasoning is not None and isinstance(request, ChatCompletionRequest):
            # a thinking model reasons freely first; the constraint governs the answer after </think>
            so = dataclasses.replace(so, after_reasoning=self.reasoning.name)
        params = structured.with_constraint(params, so)
        await structured.check(self.async_engine, params, field, self.limits.max_structured_output_bytes)
        return params

    def beam_search_params(self, request) -> BeamSearchParams:
        """use_beam_search's BeamSearchParams, checked against this engine: a 400 before any work."""
        params = request.to_beam_search_params(self.engine.max_model_len)
        engine = self.engine
        try:
            beam_capable_proposer(engine.proposer, params.beam_width, engine.config.max_num_seqs,
                                  engine.config.max_num_batched_tokens, engine.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param="best_of" if getattr(request, "best_of", None) else "n",
                           code="invalid_value") from None
        return params

    async def completions(self, request: CompletionRequest, raw: Request, endpoint: str = "completions",
                          lora_mix: LoRAMix | None = None) -> Response:
        """``endpoint``: the metrics' label (``completion`` / ``infill`` when llama-server's endpoints ask);
        ``lora_mix``: llama-server's per-request ``lora`` list."""
        lora = self.request_lora(request, lora_mix)
        arrival = time.monotonic()
        params = await self.constrained(request, self.sampling_params(request))
        prompts = request.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise APIError(400, f"at most {self.limits.max_prompts} prompts per request, got {len(prompts)}",
                           param="prompt", code="too_many_prompts")
        if request.suffix:   # fill in the middle: each prompt is the prefix
            try:
                prompts = [await self.async_engine.run_off_thread(fim_prompt, self.tokenizer, p, request.suffix)
                           for p in prompts]
            except ValueError as e:
                raise APIError(400, str(e), param="suffix", code="invalid_value") from None
            params = fim_params(self.tokenizer, params)
        engine_params = self.beam_search_params(request) if request.use_beam_search else params
        streams = await start_requests(self.async_engine, prompts, engine_params, "prompt", request.priority, endpoint,
                                       lora)
        return await self._respond(request, raw, streams, params, arrival, chat=False, endpoint=endpoint)

    async def chat_completions(self, request: ChatCompletionRequest, raw: Request, endpoint: str = "chat") -> Response:
        """``endpoint``: the metrics' label (``responses`` when the Responses API asks)."""
        lora = self.request_lora(request)
        arrival = time.monotonic()
        params = await self.constrained(request, self.sampling_params(request))
        engine_params = self.beam_search_params(request) if request.use_beam_search else params
        prompt = await self.async_engine.run_off_thread(self.chat_prompt, request)
        streams = await start_requests(self.async_engine, [prompt], engine_params, "messages", request.priority,
                                       endpoint, lora)
        return await self._respond(request, raw, streams, params, arrival, chat=True, endpoint=endpoint)

    async def _respond(self, request, raw: Request, streams, params, arrival: float, chat: bool,
                       endpoint: str | None = None) -> Response:
        m, ln = self.metrics, self.model_name
        m.requests.labels(ln, endpoint or ("chat" if chat else "completions")).inc()
        n = params.n
        prompt_only = getattr(request, "prompt_only", False)
        choices = [ChoiceState(i, list(params.stop), arrival, counts_prompt=i % n == 0, prompt_only=prompt_only)
                   for i in range(len(streams) * n)]
        if request.stream:
            def abort_unfinished():
                for s in streams:
                    if not s.finished:
                        self.async_engine.abort(s.request_id)

            return SSEResponse(self._stream(request, streams, choices, params, chat, n), on_close=abort_unfinished)
        m.running.labels(ln).inc(len(streams))
        try:
            completed = await collect(self.async_engine, streams, choices, raw, m.record_finish, n)
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
        num_top = params.logprobs      # None: not asked for (a beam's output carries them anyway)
        for c in choices:
            completion = c.output.outputs[0]
            n = len(completion.token_ids)
            if chat:
                reasoning, text = None, completion.text
                if self.reasoning is not None:
                    reasoning, text = self.reasoning.split(text)
                message, finish = {"role": "assistant", "content": text}, completion.finish_reason
                if tool_calls.mode(request):
                    content, calls = parse_whole(text or "", tool_names(request))
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": [t.as_dict() for t in calls]}
                        finish = "tool_calls" if finish == "stop" else finish
                if self.reasoning is not None:
                    message["reasoning_content"] = message["reasoning"] = reasoning
                choice = {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(self.tokenizer, completion, 0, n, num_top),
                    "finish_reason": finish,
                    "stop_reason": completion.stop_reason,
                }
            else:
                text, logprobs = completion.text, completion_logprobs(self.tokenizer, completion, 0, n, num_top, 0)
                if request.echo:
                    echoed = prompt_text(self.tokenizer, c.output)
                    text = echoed + text
                    logprobs = joined(echo_logprobs(self.tokenizer, c.output, num_top),
                                      completion_logprobs(self.tokenizer, completion, 0, n, num_top, len(echoed)))
                choice = {
                    "index": c.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(c.output)
            if request.wants_provenance:
                tokens = token_entries(self.tokenizer, completion, 0, n, params.skip_special_tokens)
                choice["specserve"] = choice_extension(tokens, completion)
            body_choices.append(choice)
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.answer_model(request),
            "choices": body_choices,
            "usage": self._usage(choices, params),
        }
        if chat and request.prompt_logprobs is not None:   # vLLM's place for them in chat: the response's
            body["prompt_logprobs"] = prompt_logprobs_json(choices[0].output)
        return JSONResponse(body)

    async def _stream(self, request, streams, choices: list[ChoiceState], params, chat: bool, n: int = 1) -> AsyncIterator[str]:
        m, ln = self.metrics, self.model_name
        created, rid = now(), random_id("chatcmpl" if chat else "cmpl")
        model = self.answer_model(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = request.include_usage
        num_top = params.logprobs      # None: not asked for (a beam's output carries them anyway)
        provenance = request.wants_provenance
        offsets = [0] * len(choices)
        echoed = [False] * len(choices)
        counted_prompt = [False] * len(choices)
        # Chat with tools: each choice's text split into content and completed calls as it streams.
        parsers = ([ToolCallStream(tool_names(request)) for _ in choices]
                   if chat and tool_calls.mode(request) else None)
        # A thinking model's reasoning split off first (reasoning.py): the tool calls are in the answer.
        thinking = [self.reasoning.stream() for _ in choices] if chat and self.reasoning is not None else None

        # vLLM's continuous_usage_stats: every chunk carries the usage so far, not only the last
        continuous = include_usage and bool(request.stream_options.continuous_usage_stats)

        def chunk(choice_list: list[dict], final_usage: Any = None, with_usage: bool = False) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choice_list}
            if include_usage:
                body["usage"] = final_usage if with_usage else usage(choices) if continuous else None
            return sse(body)

        m.running.labels(ln).inc(len(streams))
        try:
            if chat:
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            async for i, out in choice_outputs(self.async_engine, streams, n):
                c = choices[i]
                c.update(out)
                if not counted_prompt[i] and c.counts_prompt:
                    counted_prompt[i] = True
                    m.prompt_tokens.labels(ln).inc(len(out.prompt_token_ids))
                step = c.next_delta()
                if step is None:
                    continue
                delta, start, end = step
                completion = c.output.outputs[0]   # (echo with max_tokens 0: without the sampled token)
                finish = completion.finish_reason if out.finished else None
                tokens = (token_entries(self.tokenizer, completion, start, end, params.skip_special_tokens)
                          if provenance else None)
                if chat:
                    call_deltas, reasoning = [], ""
                    if thinking is not None:
                        reasoning, delta = thinking[i].feed(delta, final=finish is not None)
                    if parsers is not None:
                        delta, call_deltas = parsers[i].feed(delta, final=finish is not None)
                        if finish == "stop" and parsers[i].calls:
                            finish = "tool_calls"
                    if delta or call_deltas or reasoning or (start < end and (num_top is not None or provenance)):
                        body_delta = {"content": delta} if delta or not (call_deltas or reasoning) else {}
                        if reasoning:
                            body_delta["reasoning_content"] = body_delta["reasoning"] = reasoning
                        if call_deltas:
                            body_delta["tool_calls"] = call_deltas
                        choice = {
                            "index": c.index,
                            "delta": body_delta,
                            "logprobs": chat_logprobs(self.tokenizer, completion, start, end, num_top),
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
                    prefix = ""
                    if request.echo and not echoed[i]:   # the choice's first chunk: the prompt before its text
                        echoed[i] = True
                        prefix = prompt_text(self.tokenizer, out)
                        offsets[i] = len(prefix)
                    lp = completion_logprobs(self.tokenizer, completion, start, end, num_top, offsets[i])
                    if prefix:
                        lp = joined(echo_logprobs(self.tokenizer, out, num_top), lp)
                    offsets[i] += len(delta)
                    delta = prefix + delta
                    choice = {"index": c.index, "text": delta, "logprobs": lp, "finish_reason": finish}
                    if finish is not None:
                        choice["stop_reason"] = completion.stop_reason
                    if provenance:
                        choice["specserve"] = choice_extension(tokens, completion if finish is not None else None)
                    yield chunk([choice])
                if out.finished:
                    m.record_finish(c)
            if include_usage:
                yield chunk([], self._usage(choices, params), with_usage=True)
        except (EngineStepError, EngineDeadError, RequestFailedError) as e:
            err = engine_error(e)
            m.errors.labels(ln, str(err.status)).inc()
            yield sse(error_body(err.message, err.type, err.param, err.code))
        finally:
            m.running.labels(ln).dec(len(streams))
            for c in choices:  # left early (client gone): those requests were aborted
                if c.output is None or not c.output.finished:
                    m.finished.labels(ln, "abort").inc()
        yield "data: [DONE]\n\n"


def tool_names(request) -> set[str]:
    return {t.function.name for t in request.tools or []}
