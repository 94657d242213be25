"""A ``StructuredOutput`` -> a compiled grammar (llguidance), checked, bounded and cached.

Why llguidance (docs/serving.md, "Structured output and tools", has the measurements): it
bounds every cost of a grammar with deterministic limits (``LLParserLimits``: grammar size,
lexer states, fuel per compile and per mask), so a hostile schema or regex is refused or
stopped, never a process that runs out of memory (xgrammar 0.2.9 took 21 GB and was killed
compiling a 1 MB schema here); it builds its lexer lazily, so compiling takes about a
millisecond; and it has no dependencies (xgrammar pulls triton on Linux).

One ``LLTokenizer`` per engine (built on the first constrained request: about 0.3 s for the
default model's 49,152 tokens). A compiled grammar is a matcher in its start state; each
request gets a deep copy of it (about 10 us), so the cache (LRU, ``CACHE_ENTRIES``) holds
one per distinct constraint. Refusals are cached too, so a hostile constraint sent again
costs a lookup.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
from dataclasses import dataclass

import torch

from specserve.reasoning_formats import CLOSE, OPEN, STARTS_INSIDE
from specserve.sampling_params import StructuredOutput
from specserve.structured_output.bitmask import allowed_tokens, words_for
from specserve.structured_output.ll_tokenizer import InvalidTokenizerError, ll_tokenizer

CACHE_ENTRIES = 256
PROBE_TOKENS = 4     # tokens walked at compile time (``GrammarCompiler._probe``)


class InvalidConstraintError(ValueError):
    """A schema, regex, choice or grammar that cannot be used, with why (a 400 at the server)."""

    def __init__(self, message: str, kind: str, code: str = "invalid_structured_output"):
        super().__init__(message)
        self.kind = kind      # StructuredOutput.kind: which field it was
        self.code = code


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one constraint (docs/serving.md's limits table has the server's).

    ``max_source_bytes``: the constraint's text (a schema as JSON). The others are llguidance's
    parser limits, tightened from its defaults: ``max_grammar_size`` symbols after compiling,
    ``max_lexer_states`` (1-2 kB each), ``initial_lexer_fuel`` (regex analysis; half the
    default: an exploding regex such as ``a{1000}{1000}`` is refused after 0.3 s instead of
    3 s, and a 32 KB schema of 400 patterned, enum and email fields still compiles in 0.1 s)
    and ``step_lexer_fuel`` / ``step_max_items`` (per mask). A grammar that hits one while a
    request runs ends that request (finish_reason "error"), never the engine.
    """

    max_source_bytes: int = 256 * 1024
    max_grammar_size: int = 200_000
    max_lexer_states: int = 50_000
    initial_lexer_fuel: int = 500_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000

    def parser_limits(self):
        import llguidance

        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size, max_lexer_states=self.max_lexer_states,
            initial_lexer_fuel=self.initial_lexer_fuel, step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items, verbose_errors=False,
        )


# JSON is written compactly, with the separators of Python's json.dumps (the commonest in
# text models learn from) and no free whitespace: a small model under a schema that allows
# any whitespace can emit newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form, or Lark) of a constraint; raises
    InvalidConstraintError where the text cannot even be turned into one (a GBNF grammar that
    does not convert). With ``after_reasoning``, the constraint follows free reasoning."""
    import llguidance

    kind = so.kind
    try:
        if kind in ("json_schema", "json_object"):
            text = llguidance.LLMatcher.grammar_from_json_schema(so.source, defaults=JSON_OPTIONS)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(so.regex)
        elif kind == "choice":
            text = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
        else:
            text = llguidance.grammar_from("grammar", so.grammar)   # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise InvalidConstraintError(f"invalid {kind}: {e}", kind) from None
    return text if so.after_reasoning is None else after_reasoning(text, so.after_reasoning)


# The reasoning, free text up to the first </think> (lazy: it ends there), and reasoning never
# closed, which may end the output (an unconstrained model may stop while thinking). llguidance
# Lark; "@answer" is the constraint's own grammar, a subgrammar with its own lexer.
_CLOSE_RE = re.escape(CLOSE).replace("/", "\\/")          # as written inside Lark's /.../
_THOUGHT = f"""thought[lazy]: /(?s:.*){_CLOSE_RE}/
UNFINISHED: /(?s:.*)/ & ~/(?s:.*){_CLOSE_RE}(?s:.*)/
OPEN: {json.dumps(OPEN)}
"""
_REASONING_FIRST = {
    True: "start: thought @answer | UNFINISHED\n" + _THOUGHT,                                # deepseek_r1
    False: "start: @answer | OPEN thought @answer | OPEN UNFINISHED\n" + _THOUGHT,           # qwen3
}


def after_reasoning(answer_grammar: str, reasoning_format: str) -> str:
    """A grammar (llguidance JSON or Lark) -> one that lets the model reason first, by the
    format's rule (``reasoning_formats``), and then follows it from right after ``</think>``."""
    if answer_grammar.lstrip().startswith("{"):
        top = json.loads(answer_grammar)
        answer, others = top["grammars"][0], top["grammars"][1:]
    else:
        answer, others = {"lark_grammar": answer_grammar}, []
    first = {"name": "reasoning_first", "lark_grammar": _REASONING_FIRST[STARTS_INSIDE[reasoning_format]]}
    return json.dumps({"grammars": [first, {**answer, "name": "answer"}, *others]})


class CompiledGrammar:
    """A checked grammar: a matcher in its start state, copied for each request."""

    def __init__(self, template, vocab_size: int):
        self._template = template
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def new_matcher(self):
        with self._lock:
            return self._template.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server compiles off the engine thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, limits: GrammarLimits | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.limits = limits or GrammarLimits()
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        # (kind, source, after_reasoning) -> the grammar or its refusal
        self._cache: collections.OrderedDict[tuple, CompiledGrammar | InvalidConstraintError] = collections.OrderedDict()

    def ll_tokenizer(self):
        """The tokenizer as llguidance sees it (``ll_tokenizer.py``; built once, on first use)."""
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_id)
                except InvalidTokenizerError as e:   # a slow (Python) tokenizer
                    raise InvalidConstraintError(f"structured output needs a fast tokenizer: {e}", "tokenizer",
                                                 code="unsupported") from None
            return self._ll_tokenizer

    def compile(self, so: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of ``so`` (cached); raises InvalidConstraintError naming the problem."""
        source = so.source
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_source_bytes:
            raise InvalidConstraintError(f"the {so.kind} is {size} bytes, more than the limit of "
                                         f"{self.limits.max_source_bytes}", so.kind, code="structured_output_too_large")
        key = (so.kind, source, so.after_reasoning)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = self._compile(so)
            except InvalidConstraintError as e:
                hit = e
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        if isinstance(hit, InvalidConstraintError):
            raise hit
        return hit

    def _compile(self, so: StructuredOutput) -> CompiledGrammar:
        import llguidance
        import llguidance.torch as llt

        if so.after_reasoning is not None:    # the answer's grammar checked (and probed) on its own first
            self.compile(dataclasses.replace(so, after_reasoning=None))
        tok = self.ll_tokenizer()
        text = grammar_text(so)
        limits = self.limits.parser_limits()
        error = llguidance.LLMatcher.validate_grammar(text, tok, limits=limits)
        if error:
            raise InvalidConstraintError(f"invalid {so.kind}: {_first_line(error)}", so.kind)
        matcher = llguidance.LLMatcher(tok, text, log_level=0, limits=limits)
        # The start state's mask builds the lexer's first states: a regex whose analysis runs
        # out of fuel fails here, before the request is queued.
        mask = torch.empty(1, words_for(self.vocab_size), dtype=torch.int32)
        llt.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error():
            raise InvalidConstraintError(f"invalid {so.kind}: {_first_line(matcher.get_error())}", so.kind)
        if so.after_reasoning is None:        # a probe would walk the reasoning
            self._probe(so, matcher.deep_copy(), mask)
        return CompiledGrammar(matcher, self.vocab_size)

    def _probe(self, so: StructuredOutput, matcher, mask: torch.Tensor) -> None:
        """Walk the first PROBE_TOKENS tokens (the lowest allowed id each time, never the end of
        sequence) on a copy: a regex that explodes (``a{1000}{1000}``) runs out of its limits
        within its first tokens, and is refused here rather than cut short in the engine."""
        import llguidance.torch as llt

        for _ in range(PROBE_TOKENS):
            allowed = allowed_tokens(mask, self.vocab_size)[0]
            allowed[self.eos_token_id if self.eos_token_id is not None else 0] &= self.eos_token_id is None
            ids = allowed.nonzero()
            if not len(ids) or not matcher.consume_token(int(ids[0])):
                break
            llt.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error():
            raise InvalidConstraintError(f"the {so.kind} is too complex to follow within the grammar limits: "
                                         f"{_first_line(matcher.get_error())}", so.kind,
                                         code="structured_output_too_complex")


def _first_line(message: str) -> str:
    """llguidance's message without what it may append (``<state>``, ``<non-verbose/>``, a backtrace)."""
    return message.strip().split("\n<")[0].strip()[:500]


def request_grammar(compiler: GrammarCompiler, so: StructuredOutput):
    """A fresh matcher state for one request (``matcher.RequestGrammar``)."""
    from specserve.structured_output.matcher import RequestGrammar

    return RequestGrammar(compiler.compile(so).new_matcher(), compiler.vocab_size, compiler.eos_token_id)
