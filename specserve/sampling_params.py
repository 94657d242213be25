"""Per-request sampling parameters (the vLLM names, so users feel at home).

Every field is checked on construction against what the tensors it becomes can
hold, so a bad value is a ValueError here, never an engine step that fails for
the whole batch: floats must be finite, integers must be real ``int`` (not
``bool``), ``top_k`` and token ids fit the sampler's int64 tensors, and a seed
is what ``torch.Generator.manual_seed`` takes, [0, 2^64).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from specserve.reasoning_formats import STARTS_INSIDE

_MAX_LOGPROBS = 20
MAX_BAD_WORDS = 1024
# Temperatures below this are greedy (argmax), exactly like temperature 0: dividing
# logits by 1e-50 overflows float32 and the softmax becomes NaN. vLLM uses the same 1e-5.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1         # top_k above the vocabulary size keeps every token
MAX_TOKEN_ID = 2**31 - 1
MAX_SEED = 2**64 - 1          # torch.Generator.manual_seed's range, [0, 2^64)
MAX_N = 128                   # samples of one prompt per request (the OpenAI API's limit)
MAX_LOGIT_BIAS_ENTRIES = 2048
MAX_CHOICES = 1024            # StructuredOutput.choice entries


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class StructuredOutput:
    """A constraint on a request's output: exactly one of

    - ``json_schema``: a JSON schema (a dict, or its JSON text); the output is one JSON value it
      validates, written compactly with ", " and ": " separators and no other whitespace;
    - ``json_object``: True for any JSON object (OpenAI's ``response_format: {"type": "json_object"}``);
    - ``regex``: the output matches this regular expression whole (Rust ``regex`` syntax, which
      llguidance takes: Python's, without look-around or back-references);
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a context-free grammar, in llguidance's Lark dialect or in llama.cpp's GBNF
      (a ``root ::= ...`` rule), detected from its text.

    ``after_reasoning`` ("deepseek_r1" or "qwen3", ``specserve.reasoning_formats``): the model
    reasons first, between ``<think>`` and ``</think>`` by that format's rule, and the constraint
    governs the answer right after ``</think>``; the reasoning is left free (and may end the
    output, as an unconstrained model may). The chat API sets it when the server has a
    ``--reasoning-parser``, as vLLM does.

    Checked here for shape only; whether the schema, regex or grammar is valid is decided when the
    engine compiles it (``structured_output.compiler``), before the request is queued. Sampling
    under a constraint is plain constrained sampling: every position's distribution is the
    model's, with the tokens the constraint forbids there removed, with or without speculation.
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    after_reasoning: str | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid StructuredOutput: {msg}")

        if self.after_reasoning is not None and self.after_reasoning not in STARTS_INSIDE:
            raise bad(f"after_reasoning must be one of {sorted(STARTS_INSIDE)} or None, got {self.after_reasoning!r}")

        if not isinstance(self.json_object, bool):
            raise bad(f"json_object must be True or False, got {self.json_object!r}")
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise bad(f"set exactly one of json_schema, json_object, regex, choice, grammar; got {given or 'none'}")
        if self.json_schema is not None:
            if isinstance(self.json_schema, str):
                try:
                    schema = json.loads(self.json_schema)
                except ValueError as e:
                    raise bad(f"json_schema is not JSON: {e}") from None
            else:
                schema = self.json_schema
            if not isinstance(schema, (dict, bool)):
                raise bad(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES \
                    or any(not isinstance(c, str) or not c for c in self.choice):
                raise bad(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which constraint: "json_schema", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None)

    @property
    def source(self) -> str:
        """The constraint as text (a schema as JSON, choices as a JSON list): what its size is
        measured on and what compiled grammars are cached by (with ``kind``)."""
        value = {"json_object": '{"type":"object"}'}.get(self.kind, getattr(self, self.kind))
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 (or below ``GREEDY_TEMPERATURE``, 1e-5) means greedy (argmax);
    top_k <= 0 (or -1) disables top-k; top_p 1.0 and min_p 0.0 disable those
    filters. ``seed`` makes a request's random choices reproducible alone or in
    any batch. ``logprobs=n`` returns the chosen token's log-probability and
    the top n alternatives (0 = chosen only), of the model's raw distribution.
    ``prompt_logprobs=n`` does the same for every prompt token after the first, each under the
    tokens before it (``RequestOutput.prompt_logprobs``; what perplexity and log-likelihood
    evaluations read). Such a request computes its whole prompt: it takes no prefix cache hit.

    ``n`` samples of one prompt come back as ``n`` outputs of one request; they
    share the prompt's prefill (its KV blocks). With a seed, sample i uses seed + i.

    Penalties and biases change the logits before temperature, in vLLM's order:
    ``logit_bias`` ({token id: bias in [-100, 100]}) is added, then
    ``repetition_penalty`` (> 1 discourages; it divides positive logits and
    multiplies negative ones of every token in the prompt or the output), then
    ``frequency_penalty`` (times how often a token is in the output) and
    ``presence_penalty`` (once if it is) are subtracted; both in [-2, 2] as in
    OpenAI's API. Under speculation each position uses exactly the tokens before
    it, accepted draft tokens included (``sample.penalties``).

    ``structured_output`` (a ``StructuredOutput``, or a dict of its fields) constrains the
    output to a JSON schema, a regex, a choice of strings or a grammar; a request whose
    constraint cannot finish within ``max_tokens`` ends with finish_reason "length".

    ``allowed_token_ids`` (vLLM's): every other token gets probability 0. ``bad_words`` (vLLM's):
    the output never holds one of these words' token sequences (with or without a leading
    space): a row whose tokens before it end with all but a word's last token gives that last
    token probability 0. A stop string ends the text before it unless
    ``include_stop_str_in_output``.

    ``truncate_prompt_tokens`` (vLLM's): only the prompt's last k tokens are kept (-1: as many as
    the context holds with one to generate); ``RequestOutput.prompt`` is then None.

    ``min_tokens`` (vLLM's): until the output holds that many tokens, the end-of-sequence token
    and ``stop_token_ids`` get probability 0 and stop strings are not looked for; under
    speculation each verified position counts the drafts before it, as the penalties do.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutput(**self.structured_output)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"invalid SamplingParams: structured_output must be a StructuredOutput, "
                             f"got {self.structured_output!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"invalid SamplingParams: stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"invalid SamplingParams: stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"invalid SamplingParams: logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r}")
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid SamplingParams: {msg}")

        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            raise bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.min_tokens and self.structured_output is not None:
            raise bad("min_tokens cannot go with structured output: the constraint decides where the output may end")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (-1 <= self.top_k <= MAX_TOP_K):
            raise bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer up to {MAX_TOP_K}, got {self.top_k!r}")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed <= MAX_SEED)):
            raise bad(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not (0 <= self.logprobs <= _MAX_LOGPROBS)):
            raise bad(f"logprobs must be an integer in [0, {_MAX_LOGPROBS}] (or None), got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not (0 <= self.prompt_logprobs <= _MAX_LOGPROBS)):
            raise bad(f"prompt_logprobs must be an integer in [0, {_MAX_LOGPROBS}] (or None), "
                      f"got {self.prompt_logprobs!r}")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or not (self.truncate_prompt_tokens >= 1
                                                                or self.truncate_prompt_tokens == -1)):
            raise bad(f"truncate_prompt_tokens must be a positive integer or -1 (the model's context), "
                      f"got {self.truncate_prompt_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or not (0 <= t <= MAX_TOKEN_ID) for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not (-2.0 <= value <= 2.0):
                raise bad(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not (0.0 < self.repetition_penalty <= 10.0):
            raise bad(f"repetition_penalty must be a number in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or not (0 <= token <= MAX_TOKEN_ID):
                    raise bad(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not _is_real(bias) or not (-100.0 <= bias <= 100.0):
                    raise bad(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids or any(
                    not _is_int(t) or not (0 <= t <= MAX_TOKEN_ID) for t in self.allowed_token_ids):
                raise bad(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                          f"got {self.allowed_token_ids!r}")
            if self.structured_output is not None:
                raise bad("allowed_token_ids cannot go with structured output: the constraint masks the tokens")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS:
                got = len(self.bad_words) if isinstance(self.bad_words, list) else type(self.bad_words).__name__
                raise bad(f"bad_words must be a list of at most {MAX_BAD_WORDS} words, got {got}")
            wrong = [w for w in self.bad_words if not isinstance(w, str) or not w.strip() or len(w) > 256]
            if wrong:
                raise bad(f"bad_words must be non-blank strings of up to 256 characters, got {wrong[0]!r:.80}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, biases, min_tokens, allowed_token_ids or bad_words change the model's
        logits before sampling."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0 or self.min_tokens > 0 or self.allowed_token_ids is not None \
            or bool(self.bad_words)
