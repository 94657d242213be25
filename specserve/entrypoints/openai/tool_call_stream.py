"""A streamed chat answer with tools -> ``delta.content`` text and OpenAI's ``delta.tool_calls``
pieces, as they become certain.

OpenAI streams a call in pieces: the first delta carries its index, id, type and function name
with ``"arguments": ""``; the next ones carry the index and the next piece of the arguments' JSON
text, whose concatenation is the call's arguments. So does this stream, for calls in the format
of ``tool_calls`` (a JSON object in a ``<tool_call>`` block):

- Text that could still open a block (a tail that is a prefix of ``<tool_call>``) is held back.
- Once a block reads ``{"name": "<a known function>", "arguments": `` followed by an object or
  an array, the call's first delta is sent, then the arguments as they arrive: a small JSON
  scanner (strings, escapes, nesting) finds where the value ends, so the closing brace of the
  call's own object is never sent as arguments.
- Anything else (a block that names its arguments first, or an unknown function, or holds no
  call) waits for the block to close and is then sent whole: as one call delta, or as content.

A call whose arguments were streamed stays a call (the pieces are out): if its block is cut by
``max_tokens`` or breaks after the arguments, its arguments are the text the model wrote, as
with OpenAI. Under ``tool_choice`` "required" or a named function the grammar rules that out.

Text between calls (or before the first, after the last) that is only whitespace is not
content: a run of text's leading whitespace is held until text follows it. The server reads a
whole answer with the same rule fed at once (``parse_whole``), so a whole answer and its stream
give the same content and calls, even cut by ``max_tokens``.

An answer that starts as JSON could be a call written without a block (``tool_calls.parse_bare``):
one that starts with ``{``, ``[`` or ```` ```json ```` is held back whole and read at its end as
the whole answer is (its calls whole, or its text as content), so a stream and a whole answer
give the same calls.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from specserve.entrypoints.openai.tool_calls import (
    BARE_FENCE, CALL_MARKERS, CLOSE, OPEN, ToolCall, parse, parse_block,
)

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=[\[{])')


class _ValueScanner:
    """Where a JSON object or array that arrives in pieces ends."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def take(self, text: str) -> int:
        """How many leading characters of ``text`` still belong to the value."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
        return len(text)


@dataclass
class _Block:
    """The open block: its call once its arguments stream, or left whole (``whole``)."""

    call: ToolCall | None = None
    index: int = 0
    arguments_at: int = 0                 # where the arguments' value starts in the block's body
    scanner: _ValueScanner = field(default_factory=_ValueScanner)
    whole: bool = False


class ToolCallStream:
    def __init__(self, names: set[str]):
        self.names = names
        self.pending = ""          # received, not yet sent (an open block: from its ``<tool_call>``)
        self.calls: list[ToolCall] = []
        self._block: _Block | None = None
        self._bare: bool | None = None       # the answer may be a call without a block (None: not known yet)
        self._held = ""                      # whitespace that begins a run of text, not sent yet (``_text``)
        self._run_has_text = False           # the current run of text (since the last call) has text

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """New text -> (content to send, ``delta.tool_calls`` entries to send)."""
        self.pending += text
        if self._bare is None:
            start = self.pending.lstrip()
            if start.startswith(("{", "[", BARE_FENCE, *CALL_MARKERS)):
                self._bare = True
            elif not final and (not start or any(m.startswith(start) for m in (BARE_FENCE, *CALL_MARKERS))):
                return "", []                 # too soon to tell
            else:
                self._bare = False
        if self._bare:
            if not final:
                return "", []
            content, calls = parse(self.pending, self.names)
            self.pending, self.calls = "", calls
            return content or "", [c.as_delta(i) for i, c in enumerate(calls)]
        content, deltas = [], []
        while True:
            if self._block is None:
                start = self.pending.find(OPEN)
                if start < 0:
                    keep = 0 if final else _open_prefix_len(self.pending)
                    self._text(self.pending[: len(self.pending) - keep], content)
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                self._text(self.pending[:start], content)
                self.pending = self.pending[start:]
                self._block = _Block()
            end = self.pending.find(CLOSE)
            body = self.pending[len(OPEN): end if end >= 0 else len(self.pending)]
            deltas += self._stream_arguments(body)
            if end < 0:
                if final:
                    if self._block.call is None:
                        self._text(self.pending, content)      # a cut block that never became a call: text
                    self.pending, self._block = "", None
                break
            block_end = end + len(CLOSE)
            if self._block.call is None:
                call = parse_block(body.strip(), self.names)
                if call is None:
                    self._text(self.pending[:block_end], content)
                else:
                    self._call_begins()
                    deltas.append(call.as_delta(len(self.calls)))
                    self.calls.append(call)
            self.pending, self._block = self.pending[block_end:], None
        if final and not self.calls:          # no call after all: held whitespace is content
            content.append(self._held)
            self._held = ""
        return "".join(content), deltas

    def _text(self, text: str, out: list[str]) -> None:
        """Content text, in order. Text between calls (or before the first, after the last) that
        is only whitespace is not content when the answer has calls, so a run's leading
        whitespace is held until text follows it (sent with it) or a call does (dropped)."""
        if not text:
            return
        if not self._run_has_text and not text.strip():
            self._held += text
            return
        out.append(self._held + text)
        self._held, self._run_has_text = "", True

    def _call_begins(self) -> None:
        """A call's block: the run of text before it ends, its held whitespace dropped."""
        self._held, self._run_has_text = "", False

    def _stream_arguments(self, body: str) -> list[dict]:
        b = self._block
        if b.whole:
            return []
        out = []
        if b.call is None:
            m = _HEADER.match(body)
            if m is None:
                return []             # not yet (or never: then the block is sent whole at its end)
            if m.group("name") not in self.names:
                b.whole = True
                return []
            self._call_begins()
            b.call = ToolCall(m.group("name"), "", f"call_{uuid.uuid4().hex[:24]}")
            b.index, b.arguments_at = len(self.calls), m.end()
            self.calls.append(b.call)
            out.append(b.call.as_delta(b.index))                     # arguments ""
        new = body[b.arguments_at + len(b.call.arguments):]
        piece = new[: b.scanner.take(new)]
        if piece:
            b.call.arguments += piece
            out.append({"index": b.index, "function": {"arguments": piece}})
        return out


def parse_whole(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content or None, the calls) of a whole answer: the stream's rule fed at once, so a whole
    answer and its stream always give the same calls and content (a block cut by ``max_tokens``
    whose arguments had begun is a call in both; a streamed call's arguments are the text the
    model wrote in both)."""
    stream = ToolCallStream(names)
    content, _ = stream.feed(text, final=True)
    return content or None, stream.calls


def _open_prefix_len(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0
