"""Request and response shapes of the OpenAI API subset the server speaks.

Requests are strict: unknown fields and wrong types are a 400, not a silent
default (``"max_tokens": "8"`` is an error). Every number is bounded by what
the tensor it becomes can hold (``SamplingParams``' limits: finite floats,
``top_k`` up to 2^31 - 1, seeds in [0, 2^64), token ids >= 0), so no value
that passes here can fail an engine step. OpenAI fields specserve cannot
honour (best_of > 1 without use_beam_search) are accepted only at their neutral value.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specserve.beam_search_params import BeamSearchParams
from specserve.engine.input_checks import MAX_PRIORITY
from specserve.sampling_params import (
    MAX_BAD_WORDS, MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_SEED, MAX_TOKEN_ID, MAX_TOP_K, SamplingParams,
)

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# Bounded fields that the Responses API's request (responses.py) takes too
TopK = Annotated[int, Field(ge=-1, le=MAX_TOP_K)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0)]
Priority = Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]

MAX_LOGPROBS = 20
MAX_ALLOWED_TOKEN_IDS = 1 << 18   # the largest vocabularies (Gemma's 262,144)
MAX_MIN_TOKENS = 1 << 20   # beyond any context; min_tokens above max_tokens is refused by SamplingParams
# SamplingParams' own defaults: for a field neither the request nor the model's generation config sets
SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaSpec(StrictModel):
    """``response_format.json_schema``: OpenAI's name, description, schema and strict."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is needed with type "json_schema", and only then')
        return self


class StructuredOutputsField(StrictModel):
    """vLLM's ``structured_outputs`` extension: exactly one of a JSON schema, any JSON object,
    a regex, a choice of strings or a grammar (Lark or GBNF)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class SpecserveOptions(StrictModel):
    """The ``specserve`` extension object of a request; OpenAI clients never send it."""

    provenance: bool = False   # each token's source (accepted / recovered / bonus / plain) and the request's stats


class _SamplingFields(StrictModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=MAX_MIN_TOKENS)] = 0   # vLLM's extension
    include_stop_str_in_output: bool = False                         # vLLM's extension
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None   # vLLM's extension
    # vLLM's extension: keep the prompt's last k tokens (-1: as many as fit)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=MAX_TOKEN_ID)] | None = None
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    user: str | None = None
    # vLLM's extension: lower runs first, under --scheduling-policy priority (else only 0)
    priority: Priority = 0
    # vLLM's extension: each prompt token's log-probability and the top n (choices[i].prompt_logprobs)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    specserve: SpecserveOptions | None = None
    # Structured output (docs/serving.md, "Structured output and tools"): OpenAI's response_format,
    # vLLM's structured_outputs, and vLLM's older guided_* names; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search extension (docs/serving.md, "Beam search"): n beams (completions: best_of beams
    # and the n best returned), ranked by cumulative log-probability / generated length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @model_validator(mode="after")
    def _beam_search_fields(self):
        if not self.use_beam_search:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                raise ValueError("length_penalty and early_stopping apply to beam search only (use_beam_search: true)")
            return self
        neutral = {"stop": ([],), "stop_token_ids": ([],), "logit_bias": (), "top_p": (1.0,), "top_k": (-1, 0),
                   "min_p": (0.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
                   "repetition_penalty": (1.0,), "response_format": (), "structured_outputs": (), "guided_json": (),
                   "guided_regex": (), "guided_choice": (), "guided_grammar": (), "specserve": (),
                   "prompt_logprobs": (), "min_tokens": (0,), "allowed_token_ids": (),
                   "include_stop_str_in_output": (False,), "bad_words": ([],), "priority": (0,),
                   **self._beam_neutral_fields()}
        bad = [name for name, allowed in neutral.items() if getattr(self, name) not in (None, *allowed)]
        if bad:
            raise ValueError(f"use_beam_search ranks beams by the model's log-probabilities alone; "
                             f"these fields cannot go with it: {bad}")
        return self

    def _beam_neutral_fields(self) -> dict:
        return {}

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, v):
        if v is not None and v <= 0:
            raise ValueError("must be at least 1")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, v, info: ValidationInfo):
        """As in vLLM: prompt logprobs come in whole responses only."""
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available with stream: true")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v is not None and not (0.0 < v <= 1.0):
            raise ValueError("must be in (0, 1]")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v):
        if v is not None and not (0.0 <= v <= 1.0):
            raise ValueError("must be in [0, 1]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        """OpenAI sends token ids as strings: {"50256": -100}."""
        if not v:
            return None
        out = {}
        for key, bias in v.items():
            if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids (decimal integers >= 0), got {key!r}")
            out[int(key)] = float(bias)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def wants_provenance(self) -> bool:
        return bool(self.specserve and self.specserve.provenance)

    def _beam_search_params(self, beam_width: int, max_tokens: int) -> BeamSearchParams:
        return BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=0.0 if self.temperature is None else float(self.temperature),
                                length_penalty=float(self.length_penalty), early_stopping=self.early_stopping)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, defaults: dict | None) -> SamplingParams:
        """``defaults``: the model's sampling defaults (``LLMEngine.sampling_defaults``), for the
        fields the request leaves out; their max_tokens caps the request's, as in vLLM."""
        defaults = defaults or {}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        model_cap = defaults.get("max_tokens")
        if model_cap is not None:
            max_tokens = model_cap if max_tokens is None else min(max_tokens, model_cap)

        def field(name: str):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, SAMPLING_DEFAULTS[name])

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(field("temperature")),
            top_p=float(field("top_p")),
            top_k=field("top_k"),
            min_p=float(field("min_p")),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            bad_words=None if self.bad_words is None else list(self.bad_words),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            n=self.n or 1,
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=float(field("repetition_penalty")),
            logit_bias=self.logit_bias,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, token ids, or a batch of either.

    ``echo``: each choice's text starts with the prompt, and with ``logprobs`` its logprobs
    start with the prompt tokens' (the first one's null), as OpenAI's legacy API gives them
    (log-likelihood evaluations read these); ``max_tokens`` 0 then answers the prompt alone."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16          # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and not (0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"must be in [0, {MAX_LOGPROBS}]")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, v):
        """0 is allowed here for echo alone (``to_sampling_params`` checks the pair)."""
        if v is not None and v < 0:
            raise ValueError("must be at least 1 (or 0 with echo: the prompt alone)")
        return v

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt, no token generated."""
        return bool(self.echo) and self.max_tokens == 0

    @model_validator(mode="after")
    def _suffix_with_text_prompts(self):
        """suffix (fill in the middle, ``entrypoints/fill_in_middle.py``): text prompts, no echo."""
        if self.suffix:
            if not all(isinstance(p, str) for p in self.prompts()):
                raise ValueError("suffix needs text prompts (the prefix), not token ids")
            if self.echo:
                raise ValueError("suffix cannot go with echo")
        return self

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info: ValidationInfo):
        """Checked after the fields it depends on (use_beam_search, n: declared before it)."""
        if v not in (None, 1) and not info.data.get("use_beam_search"):
            raise ValueError("best_of > 1 is supported with use_beam_search only (the beam width)")
        n = info.data.get("n") or 1
        if v is not None and n > v:
            raise ValueError(f"n ({n}) must be at most best_of ({v})")
        return v

    def _beam_neutral_fields(self) -> dict:
        return {"logprobs": (), "echo": (False,), "suffix": ("",)}

    def to_beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        """use_beam_search: best_of beams (default n), the n best returned."""
        return self._beam_search_params(self.best_of or self.n or 1,
                                        self.max_tokens if self.max_tokens is not None else default_max_tokens)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        def token_ids(x):
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or token_ids(v):
            return v
        if isinstance(v, list) and v and (all(isinstance(x, str) for x in v) or all(token_ids(x) for x in v)):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        raise ValueError(
            "must be a string, a list of token ids, or a batch (a list of strings or of token-id lists)"
        )

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string or token-id list per choice."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """With echo and logprobs, the prompt's logprobs too (prompt_logprobs, when not given,
        takes logprobs' n). echo with max_tokens 0 samples one token, which the answer leaves
        out (``serving.py``). ``defaults``: the model's (``_sampling_params``)."""
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo: the prompt alone)")
        max_tokens = 1 if self.prompt_only else self.max_tokens
        echoed = self.logprobs if self.echo else None
        return self._sampling_params(max_tokens, self.logprobs,
                                     self.prompt_logprobs if self.prompt_logprobs is not None else echoed, defaults)


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) are passed to the chat template untouched.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d = dict(self.model_extra or {})
        d["role"] = "system" if self.role == "developer" else self.role
        d["content"] = content or ""
        return d


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_tokens`` defaults to what the context leaves."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last (assistant) message left open for the answer to go on from; template variables
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: reaches the chat template as the variable reasoning_effort (as in vLLM: templates
    # that read it, gpt-oss's for one, change the prompt; the others ignore it)
    reasoning_effort: Annotated[str, Field(max_length=32)] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort unless they set it themselves."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_max_completion_tokens(cls, v):
        if v is not None and v <= 0:
            raise ValueError("must be at least 1")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        if v is not None and not (0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"must be in [0, {MAX_LOGPROBS}]")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools")
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise ValueError("tools: two functions have the same name")
        return self

    def _beam_neutral_fields(self) -> dict:
        return {"logprobs": (False,), "top_logprobs": (), "tools": (), "tool_choice": ()}

    def to_beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        """use_beam_search: n beams, all returned (chat has no best_of)."""
        return self._beam_search_params(self.n or 1,
                                        self.max_completion_tokens or self.max_tokens or default_max_tokens)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.max_completion_tokens or self.max_tokens, logprobs, self.prompt_logprobs,
                                     defaults)


class TokenizeRequest(StrictModel):
    """POST /tokenize (vLLM's): a completion ``prompt`` (with the tokens the tokenizer adds unless
    ``add_special_tokens`` is false) or chat ``messages`` rendered by the chat template, as the
    generation endpoints would tokenize them."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    def as_chat(self) -> "ChatCompletionRequest":
        return ChatCompletionRequest(model=self.model, messages=self.messages, tools=self.tools,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     chat_template_kwargs=self.chat_template_kwargs)


class DetokenizeRequest(StrictModel):
    """POST /detokenize (vLLM's): token ids -> text (special tokens kept)."""

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


# ---------------------------------------------------------------------- responses
def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specserve"
    root: str | None = None
    parent: str | None = None          # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


# What an embeddings request embeds: a text, token ids, or a list of either
EmbeddingInput = (str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
                  | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)])


def embedding_inputs(value) -> list[str | list[int]]:
    """An ``EmbeddingInput`` as a list of prompts."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


class EmbeddingRequest(StrictModel):
    """POST /v1/embeddings (OpenAI's): one input or a list of them, each text or token ids."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        return embedding_inputs(self.input)


class NativeEmbeddingRequest(StrictModel):
    """llama-server's POST /embedding: ``content`` (or ``input``), ``embd_normalize``."""

    model: str | None = None
    content: EmbeddingInput | None = None
    input: EmbeddingInput | None = None
    embd_normalize: int = 2

    @model_validator(mode="after")
    def _one_input(self):
        if (self.content is None) == (self.input is None):
            raise ValueError("give either content or input")
        return self

    def inputs(self) -> list[str | list[int]]:
        return embedding_inputs(self.content if self.content is not None else self.input)


class LoadLoraAdapterRequest(StrictModel):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(StrictModel):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)
