"""Tool calls in chat completions: the tools in the prompt, the constraint for ``tool_choice``
"required" or a named function, and the calls parsed out of the model's text.

The format is the one the chat templates of the families served use for tools (Qwen2.5's,
SmolLM2's and Hermes' models): each call a JSON object in its own block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that takes ``tools`` (Qwen2.5's) renders them itself; for one that does not (the
default model's) the tools and the format are described in a system message (``TOOLS_PROMPT``),
and earlier calls and tool results in the conversation are written in the same format.

- ``tool_choice`` "none": no tools in the prompt, nothing parsed.
- "auto" (the default with tools): the model writes what it wants; blocks that hold a call of
  a known function become ``tool_calls``, the rest stays ``content``. An answer without blocks
  that is nothing but such a call as JSON (bare, or in a ```json fence: ``parse_bare``) is that
  call too.
- "required" or ``{"type": "function", "function": {"name": ...}}``: the output is constrained
  (a Lark grammar embedding each function's parameters as a JSON schema) to one call, or with
  ``parallel_tool_calls`` (the default) one or more, so it always parses.

With calls, the message's ``content`` is the text outside the blocks (null when none) and
``finish_reason`` is "tool_calls"; a stream sends the text as ``delta.content`` and each call's
arguments piece by piece as ``delta.tool_calls`` entries (``tool_call_stream``).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specserve.entrypoints.chat_template import template_takes_tools
from specserve.sampling_params import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
BARE_FENCE = "```json"
CALL_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")     # Llama 3.x's and Mistral's special tokens before calls
_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL)

TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions are described in JSON within <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments within <tool_call></tool_call> tags:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""

# The JSON of a constrained call is written as the JSON constraints are (structured_output.compiler).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def mode(request) -> str | None:
    """None (no tools, or tool_choice "none"), "auto", "required" or "named"."""
    if not request.tools or request.tool_choice == "none":
        return None
    if request.tool_choice in (None, "auto"):
        return "auto"
    return "required" if request.tool_choice == "required" else "named"


def tool_dicts(request) -> list[dict]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in request.tools]


def conversation(request, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, ``tools`` to pass it or None)."""
    messages = [m.to_template_dict() for m in request.messages]
    if mode(request) is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    if template_takes_tools(tokenizer):
        for m in messages:   # templates write arguments with tojson: give them objects, not JSON text
            for call in m.get("tool_calls") or []:
                fn = call.get("function", call)
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
        return messages, (tool_dicts(request) if mode(request) else None)
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            continue
        calls = m.pop("tool_calls", None) or []
        if calls:
            blocks = [f"{OPEN}\n{json.dumps(_call_body(c))}\n{CLOSE}" for c in calls]
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + blocks)
        out.append(m)
    if mode(request):
        tools_text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tool_dicts(request)))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools_text}"}
        else:
            out.insert(0, {"role": "system", "content": tools_text})
    return out, None


def _call_body(call: dict) -> dict:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": fn.get("name"), "arguments": args}


def constraint(request) -> StructuredOutput | None:
    """The grammar of "required" / a named function: calls in the template's format whose
    arguments match the function's parameters; None for "auto" and "none"."""
    m = mode(request)
    if m not in ("required", "named"):
        return None
    functions = [t.function for t in request.tools]
    if m == "named":
        functions = [f for f in functions if f.name == request.tool_choice.function.name]
    options = [{"type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": _JSON_OPTIONS}
    several = m == "required" and request.parallel_tool_calls is not False
    lark = "\n".join([
        'start: call ("\\n" call)*' if several else "start: call",
        f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
        f"body: %json {json.dumps(schema)}",
    ])
    return StructuredOutput(grammar=lark)


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    id: str

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_delta(self, index: int) -> dict:
        return {"index": index, **self.as_dict()}


def parse_block(body: str, names: set[str]) -> ToolCall | None:
    """A block's JSON -> a call of a known function, or None (it stays text)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _call(value, names)


def _call(value, names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parse_bare(text: str, names: set[str]) -> list[ToolCall]:
    """The calls of an answer that is nothing but a call of a known function (or a list of such
    calls, or several separated by ";") as JSON, bare or in a ```json fence; else []. Models that
    answer so instead of writing blocks: Llama 3.x's tool format, Qwen2.5-Coder-1.5B's habit."""
    body = text.strip()
    for marker in CALL_MARKERS:        # kept when skip_special_tokens is off
        body = body.removeprefix(marker).lstrip()
    fenced = _FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1).strip()
    if not body.startswith(("{", "[")):
        return []
    values, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):          # one value, a list, or objects separated by ";" (Llama 3.x's parallel calls)
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return []
        values += value if isinstance(value, list) else [value]
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return []
        at = len(body) - len(rest)
    calls = [_call(v, names) for v in values]
    return calls if calls and all(calls) else []


def parse(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content outside the call blocks or None, the calls) of a whole answer; an answer with no
    block that is only a call (``parse_bare``) is that call."""
    calls, content, at = [], [], 0
    for match in _BLOCK.finditer(text):
        call = parse_block(match.group(1), names)
        if call is None:
            continue
        content.append(text[at : match.start()])
        calls.append(call)
        at = match.end()
    content.append(text[at:])
    if not calls and (bare := parse_bare(text, names)):
        return None, bare
    rest = "".join(content).strip() if calls else text
    return (rest or None), calls
