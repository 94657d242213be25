"""llama-server's own endpoints, ``POST /completion`` and ``POST /infill`` (and ``GET /props``), over the completions
handler: the native API that llama.cpp's clients call (editor code completion such as
llama.vscode sends ``/infill``), so they can use a speculating specserve server as they are.

A request is rewritten as the ``/v1/completions`` request it means (``to_completions``):
``/infill``'s ``input_extra`` files, ``input_prefix``, ``input_suffix`` and ``prompt`` (the
middle's start) become the fill-in-the-middle prompt (``fill_in_middle.infill_prompt``) with the
model's end-of-middle tokens as stop tokens; ``n_predict`` (-1: up to the context) is
``max_tokens``; the sampling options keep their meaning (``repeat_penalty`` as vLLM's
repetition penalty, over the whole context: ``repeat_last_n`` is not applied), ``grammar``
(GBNF) and ``json_schema`` constrain the output, ``n_probs`` asks for log-probabilities. The
completions handler runs it streamed, and its chunks are read as they come
(``answer_from_stream``), which gives llama-server's timings and its two code-completion
cut-offs: ``n_indent`` (a new line indented less than that ends the answer, the line cut) and
``t_max_predict_ms`` (after a new line, the answer ends once generating took that long).
Leaving early aborts the request.

Options specserve cannot honour exactly are refused with a 400 naming them (DRY, XTC,
Mirostat, dynamic temperature, locally typical sampling, post-sampling probabilities, several
prompts, LoRA adapters); ``model`` (as llama-server, one model whatever is named), ``cache_prompt``
(the prefix cache always reuses), ``samplers`` (specserve's order:
penalties, top-k, top-p, min-p, temperature), ``t_max_prompt_ms``, ``id_slot``, ``n_keep``,
``n_cache_reuse``, ``min_keep`` and ``timings_per_token`` are accepted and change nothing.
"""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from specserve.entrypoints.fill_in_middle import fim_tokens, infill_prompt
from specserve.entrypoints.openai.errors import validation_error
from specserve.entrypoints.openai.limits import APIError, with_names
from specserve.entrypoints.openai.protocol import CompletionRequest, StrictModel
from specserve.entrypoints.openai.response_format import SSEResponse, chat_chunks, sse


class ExtraChunk(StrictModel):
    filename: str = ""
    text: str = ""


class NativeRequest(StrictModel):
    """POST /completion and /infill: llama-server's options (its defaults)."""

    model: str | None = None
    prompt: str | list[int] = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=1024)] = []
    n_predict: int = -1
    n_cmpl: Annotated[int, Field(ge=1, le=16)] = 1      # completions of the prompt (an array of answers)
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: Annotated[list[str], Field(max_length=64)] = []
    seed: int = -1
    ignore_eos: bool = False
    logit_bias: dict[str, float | bool] | list[list[Any]] | None = None
    n_probs: int = 0
    stream: bool = False
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_indent: Annotated[int, Field(ge=0)] = 0
    t_max_predict_ms: Annotated[int, Field(ge=0)] = 0
    return_tokens: bool = False
    response_fields: list[str] | None = None
    post_sampling_probs: bool = False
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    mirostat: int = 0
    dynatemp_range: float = 0.0
    # accepted, changing nothing (module docstring)
    cache_prompt: bool = True
    samplers: list[str] | None = None
    t_max_prompt_ms: int = 0
    id_slot: int = -1
    n_keep: int = 0
    n_cache_reuse: int = 0
    min_keep: int = 0
    timings_per_token: bool = False
    lora: list[Any] | None = None


# the completions request's fields -> llama-server's, for the errors
NAMES = {"logprobs": "n_probs", "repetition_penalty": "repeat_penalty", "max_tokens": "n_predict"}
# options whose only supported value is their default (the sampler is off)
_OFF = {"typical_p": 1.0, "post_sampling_probs": False, "dry_multiplier": 0.0, "xtc_probability": 0.0,
        "mirostat": 0, "dynatemp_range": 0.0}


async def native_completion(serving, req: NativeRequest, raw: Request, infill: bool) -> Response:
    """POST /completion (``infill`` False) or /infill: ``req`` through the completions handler."""
    body, prompt_ids = to_completions(serving, req, infill)
    names = {**NAMES, "structured_outputs": "grammar" if req.grammar is not None else "json_schema"}
    try:
        completion_request = CompletionRequest.model_validate(body)
        answer = await serving.completions(completion_request, raw, endpoint="infill" if infill else "completion")
    except ValidationError as e:
        raise with_names(validation_error(e), names) from None
    except APIError as e:
        raise with_names(e, names) from None
    if not isinstance(answer, SSEResponse):
        return answer                                 # an error the handler answered itself
    state = NativeAnswers(serving, req, prompt_ids)
    if req.stream:
        return SSEResponse(state.events(answer.body_iterator), on_close=answer.on_close)
    try:
        async with aclosing(state.pieces(answer.body_iterator)) as pieces:
            async for _ in pieces:
                if await raw.is_disconnected():       # nobody to answer: leaving aborts the request
                    return Response(status_code=499)
    finally:
        answer.on_close()
    return JSONResponse(state.final())


def props(serving) -> dict:
    """GET /props: llama-server's server properties that its clients read (the context size
    above all: llama.vscode sizes its prompts by ``default_generation_settings.n_ctx``)."""
    from specserve import __version__

    engine = serving.engine
    defaults = NativeRequest()
    settings = {k: getattr(defaults, k) for k in ("n_predict", "temperature", "top_k", "top_p", "min_p",
                                                    "repeat_penalty", "presence_penalty", "frequency_penalty")}
    return {"default_generation_settings": {"n_ctx": engine.max_model_len, "params": settings},
            "total_slots": engine.config.max_num_seqs, "model_alias": serving.model_name,
            "model_path": engine.model_name, "chat_template": getattr(serving.tokenizer, "chat_template", None) or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"specserve {__version__}"}


def to_completions(serving, req: NativeRequest, infill: bool) -> tuple[dict, list[int] | str]:
    """(the /v1/completions body ``req`` means, its prompt); APIError for what it cannot mean."""
    for name, off in _OFF.items():
        if getattr(req, name) != off:
            raise APIError(400, f"{name} is not supported here (only {off!r}, the sampler off)", param=name,
                           code="unsupported_value")
    if req.lora:
        raise APIError(400, "LoRA adapters are not supported", param="lora", code="unsupported_value")
    if req.grammar is not None and req.json_schema is not None:
        raise APIError(400, "grammar and json_schema cannot go together", param="json_schema", code="invalid_value")
    engine = serving.engine
    tokenizer = serving.tokenizer
    max_tokens = req.n_predict if req.n_predict > 0 else None
    # ``model`` is not checked: llama-server serves one model whatever a request names (editors send theirs)
    body: dict[str, Any] = {"temperature": req.temperature, "top_p": req.top_p,
                            "top_k": req.top_k if req.top_k > 0 else -1, "min_p": req.min_p,
                            "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                            "ignore_eos": req.ignore_eos, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                            "specserve": {"provenance": True}}
    if req.n_cmpl > 1:
        body["n"] = req.n_cmpl
    if req.repeat_penalty != 1.0:
        body["repetition_penalty"] = req.repeat_penalty
    if req.stop:
        body["stop"] = req.stop
    if req.seed >= 0:
        body["seed"] = req.seed
    if req.n_probs > 0:
        body["logprobs"] = req.n_probs
    if req.grammar is not None:
        body["structured_outputs"] = {"grammar": req.grammar}
    if req.json_schema is not None:
        body["structured_outputs"] = {"json": req.json_schema}
    if req.logit_bias:
        body["logit_bias"] = _logit_bias(req.logit_bias, tokenizer)
    if infill:
        if fim_tokens(tokenizer) is None:
            raise APIError(400, "this model has no fill-in-the-middle tokens: /infill needs a code model trained on "
                                "fill-in-the-middle, such as Qwen2.5-Coder", param="input_prefix", code="unsupported_value")
        if not isinstance(req.prompt, str):
            raise APIError(400, "prompt must be text on /infill (the middle's start)", param="prompt",
                           code="invalid_value")
        budget = engine.max_model_len - (max_tokens or 1)
        prompt = infill_prompt(tokenizer, req.input_prefix, req.input_suffix,
                               [(c.filename, c.text) for c in req.input_extra], req.prompt, budget)
        body["stop_token_ids"] = list(fim_tokens(tokenizer).ends)
    else:
        if req.input_prefix or req.input_suffix or req.input_extra:
            raise APIError(400, "input_prefix, input_suffix and input_extra belong to /infill", param="input_prefix",
                           code="invalid_value")
        prompt = req.prompt
        if isinstance(prompt, str) and not prompt:
            raise APIError(400, "prompt is required", param="prompt", code="invalid_value")
    body["prompt"] = prompt
    length = len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))
    # n_predict 0 evaluates the prompt into the cache (editors warm it so): one token, not answered
    body["max_tokens"] = 1 if req.n_predict == 0 else (max_tokens or max(1, engine.max_model_len - length))
    return body, prompt


def _logit_bias(bias, tokenizer) -> dict[str, float]:
    """llama-server's biases (``{"id or text": v}`` or ``[[id or text, v], ...]``; ``false``: never)
    -> OpenAI's ``{"id": v}``; a text biases each of its tokens."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    out: dict[str, float] = {}
    for pair in pairs:
        key, value = pair if isinstance(pair, tuple) else (pair[0] if len(pair) == 2 else None, pair[-1])
        if key is None or not isinstance(value, (bool, int, float)):
            raise APIError(400, "logit_bias entries are [token id or text, bias or false]", param="logit_bias",
                           code="invalid_value")
        value = -100.0 if value is False else float(value)
        if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
            ids = [int(key)]
        else:
            ids = tokenizer.encode(str(key), add_special_tokens=False)
        for tid in ids:
            out[str(tid)] = max(-100.0, min(100.0, value))
    return out


class NativeAnswers:
    """The completions handler's stream -> llama-server's answers (``n_cmpl`` of them), piece by
    piece and whole: each chunk's choices go to their answer, and reading stops once every answer
    has ended (the engine's end, or a cut-off), which aborts the request."""

    def __init__(self, serving, req: NativeRequest, prompt, clock=time.monotonic):
        self.answers = [NativeAnswer(serving, req, prompt, clock, index=i) for i in range(req.n_cmpl)]

    async def pieces(self, chunks):
        """(index, text, tokens) of each new piece of an answer, as the engine verifies them."""
        async with aclosing(chat_chunks(chunks)) as parsed:
            async for chunk in parsed:
                if "error" in chunk:
                    raise APIError(500, chunk["error"].get("message", "engine error"), "server_error",
                                   code=chunk["error"].get("code"))
                for answer in self.answers:
                    answer.usage = chunk.get("usage") or answer.usage
                for choice in chunk.get("choices", []):
                    answer = self.answers[choice.get("index", 0)]
                    piece = answer.take(choice)
                    if piece is not None:
                        yield (answer.index, *piece)
                if all(a.cut or a.finish for a in self.answers):
                    return

    async def events(self, chunks):
        """llama-server's stream: a ``data:`` object per piece, then each answer's whole fields."""
        async with aclosing(self.pieces(chunks)) as pieces:
            async for index, text, new_tokens in pieces:
                answer = self.answers[index]
                yield sse({"index": index, "content": text, "tokens": new_tokens, "stop": False, "id_slot": 0,
                           "tokens_predicted": len(answer.tokens),
                           "tokens_evaluated": answer.usage.get("prompt_tokens", 0)})
        for answer in self.answers:
            yield sse(answer.final())

    def final(self) -> dict | list[dict]:
        """The answer, or with ``n_cmpl`` above 1 the list of them (llama-server's shape)."""
        finals = [a.final() for a in self.answers]
        return finals[0] if len(finals) == 1 else finals


class NativeAnswer:
    """One answer: its text, tokens and timings as its pieces come, and llama-server's fields."""

    def __init__(self, serving, req: NativeRequest, prompt, clock=time.monotonic, index: int = 0):
        self.serving, self.req, self.index = serving, req, index
        self.clock = clock                # seconds (the tests' own clock replaces it)
        self.prompt = prompt
        self.warm_only = req.n_predict == 0
        self.content, self.tokens, self.probs = "", [], []
        self.start = clock()
        self.first = self.last = None
        self.usage: dict = {}
        self.finish, self.stop_word, self.stats = None, "", None
        self.cut = False                  # ended by n_indent or t_max_predict_ms
        self.has_new_line = False
        self.line_start = None            # where the current line starts in content, after a new line

    def take(self, choice: dict):
        """A chunk's choice for this answer -> its new (text, tokens), or None."""
        if self.cut:
            return None
        ext = choice.get("specserve") or {}
        new_tokens = [t["id"] for t in ext.get("tokens", [])]
        if ext.get("stats"):
            self.stats = ext["stats"]
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.stop_word = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else ""
        if self.warm_only or not (new_tokens or choice.get("text")):
            return None
        now = self.clock()
        self.first = self.first or now
        self.last = now
        if choice.get("logprobs"):
            self.probs += _probs(choice["logprobs"], new_tokens)
        text = self._cut_by_indent(choice.get("text") or "")
        self.content += text
        self.tokens += new_tokens
        limit = self.req.t_max_predict_ms
        if not self.cut and self.has_new_line and limit and (now - self.first) * 1000 > limit:
            self.cut = True
        return text, new_tokens

    def _cut_by_indent(self, text: str) -> str:
        """``text`` up to where a new line starts indented less than ``n_indent`` (llama-server's
        rule: the answer ends there, that line's text cut)."""
        out = ""
        for ch in text:
            if self.cut:
                break
            if ch == "\n":
                self.has_new_line, self.line_start = True, len(self.content) + len(out) + 1
            elif self.req.n_indent and self.line_start is not None and ch not in " \t":
                indent = len(self.content) + len(out) - self.line_start
                self.line_start = None
                if indent < self.req.n_indent:
                    self.cut = True
                    break
            out += ch
        if self.cut and self.req.n_indent:
            whole = self.content + out
            out = out[: max(0, whole.rfind("\n") + 1 - len(self.content))]
        return out

    def final(self) -> dict:
        usage, req = self.usage, self.req
        prompt_n = usage.get("prompt_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        predicted = len(self.tokens)
        first = self.first or self.clock()
        prompt_ms = (first - self.start) * 1000
        predicted_ms = ((self.last or first) - first) * 1000
        if self.cut:
            stop_type = "limit"
        else:
            stop_type = {"length": "limit"}.get(self.finish, "word" if self.stop_word else "eos")
        timings = {"cache_n": cached, "prompt_n": prompt_n - cached, "prompt_ms": prompt_ms,
                   "prompt_per_token_ms": prompt_ms / max(1, prompt_n - cached),
                   "prompt_per_second": 1000 * (prompt_n - cached) / prompt_ms if prompt_ms else 0.0,
                   "predicted_n": predicted, "predicted_ms": predicted_ms,
                   "predicted_per_token_ms": predicted_ms / max(1, predicted),
                   "predicted_per_second": 1000 * predicted / predicted_ms if predicted_ms else 0.0}
        if self.stats is not None and self.stats.get("num_draft_tokens"):
            timings["draft_n"] = self.stats["num_draft_tokens"]
            timings["draft_n_accepted"] = self.stats["num_accepted_tokens"]
        body = {
            "index": self.index, "content": self.content, "tokens": self.tokens if req.return_tokens else [],
            "id_slot": 0, "stop": True, "model": self.serving.model_name,
            "tokens_predicted": predicted, "tokens_evaluated": prompt_n,
            "generation_settings": {"n_predict": req.n_predict, "temperature": req.temperature, "top_k": req.top_k,
                                    "top_p": req.top_p, "min_p": req.min_p, "seed": req.seed, "stop": req.stop,
                                    "n_probs": req.n_probs, "n_indent": req.n_indent,
                                    "t_max_predict_ms": req.t_max_predict_ms, "n_ctx": self.serving.engine.max_model_len},
            "prompt": self.prompt if isinstance(self.prompt, str) else self.serving.tokenizer.decode(self.prompt),
            "has_new_line": self.has_new_line, "truncated": False, "stop_type": stop_type,
            "stopping_word": self.stop_word if stop_type == "word" else "", "tokens_cached": cached,
            "timings": timings,
        }
        if req.n_probs > 0:
            body["completion_probabilities"] = self.probs
        return _only(body, req.response_fields) if req.response_fields else body


def _probs(logprobs: dict, ids: list[int]) -> list[dict]:
    """OpenAI completions' logprobs of a chunk -> llama-server's ``completion_probabilities``."""
    out = []
    for i, (token, logprob) in enumerate(zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", []))):
        top = (logprobs.get("top_logprobs") or [])
        alternatives = top[i] if i < len(top) and top[i] else {}
        out.append({"id": ids[i] if i < len(ids) else None, "token": token, "logprob": logprob,
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                     for t, lp in alternatives.items()]})
    return out


def _only(body: dict, fields: list[str]) -> dict:
    """llama-server's ``response_fields``: the named fields only; ``a/b`` takes ``b`` out of ``a``
    under the name ``a/b``; a missing field is left out."""
    out = {}
    for name in fields:
        value, found = body, True
        for part in name.split("/"):
            if isinstance(value, dict) and part in value:
                value = value[part]
            else:
                found = False
                break
        if found:
            out[name] = value
    return out
