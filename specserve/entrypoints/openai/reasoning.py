"""A thinking model's reasoning split from its answer (vLLM's ``--reasoning-parser``).

Models such as DeepSeek-R1 and Qwen3 write their reasoning between ``<think>`` and ``</think>``
and the answer after it (the formats: ``specserve/reasoning_formats.py``). With a parser the
chat API returns the reasoning as ``message.reasoning_content`` (and ``reasoning``, vLLM's
newer name; ``delta.*`` when streamed) and only the answer as ``content``; the tool-call
parser then reads the answer alone.

- ``deepseek_r1``: the output starts inside the reasoning: everything before ``</think>`` is
  reasoning (all of it, when the output ends before the tag: cut off while thinking).
- ``qwen3``: the output is reasoning only when it starts with ``<think>`` (else all content).

Either way a leading ``<think>`` is dropped, and the text after ``</think>`` is the content as
written (its leading newlines included, as vLLM gives it). Streamed, a piece that may be the
start of a tag is held back until the next piece tells, so a stream's pieces join to what the
whole answer splits into. A request with structured output (``response_format``, a forced
tool call) is split too: its constraint governs the answer after ``</think>`` and leaves the
reasoning free (``StructuredOutput.after_reasoning``), as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass

from specserve.reasoning_formats import CLOSE, OPEN, STARTS_INSIDE


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool      # the prompt opened the reasoning (deepseek_r1)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a whole answer: the stream's rule, fed at once."""
        reasoning, content = self.stream().feed(text, final=True)
        return reasoning or None, content or None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)

    def reasoning_tokens(self, token_ids: list[int], decode) -> int:
        """How many of an answer's tokens are reasoning: through the token that completes
        ``</think>`` (all of them when the answer ends first; none when it has no reasoning).
        ``decode(ids)`` -> their text, as the answer's text was made; a binary search, since a
        prefix that holds the tag is followed by longer ones that hold it too."""
        text = decode(token_ids)
        if not (self.starts_inside or text.startswith(OPEN)):
            return 0
        if CLOSE not in text:
            return len(token_ids)
        lo, hi = 1, len(token_ids)            # the smallest i whose prefix holds the tag is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if CLOSE in decode(token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo


PARSERS = {name: ReasoningParser(name, starts_inside) for name, starts_inside in STARTS_INSIDE.items()}


class ReasoningStream:
    """One answer's pieces -> (reasoning piece, content piece), as ``split`` would cut the whole."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.mode = None          # None: undecided (the answer may start with <think>), "reasoning", "content"
        self.held = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        text = self.held + piece
        self.held = ""
        reasoning = content = ""
        if self.mode is None:
            if OPEN.startswith(text) and not final:      # maybe the opening tag, not all of it yet
                self.held = text
                return "", ""
            if text.startswith(OPEN):
                text, self.mode = text[len(OPEN):], "reasoning"
            else:
                self.mode = "reasoning" if self.parser.starts_inside else "content"
        if self.mode == "reasoning":
            before, found, after = text.partition(CLOSE)
            if found:
                reasoning, content, self.mode = before, after, "content"
            else:
                keep = 0 if final else _tag_prefix_at_end(before)
                reasoning, self.held = before[: len(before) - keep], before[len(before) - keep:]
        else:
            content = text
        return reasoning, content


def _tag_prefix_at_end(text: str) -> int:
    """How many of ``text``'s last characters could begin ``</think>``."""
    for n in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-n:]):
            return n
    return 0
