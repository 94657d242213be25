"""tool_calls.py and tool_call_stream.py alone: the <tool_call> blocks parsed whole and
streamed in any split (arguments piece by piece, as OpenAI's clients assemble them), the
conversation written for templates with and without tools, and the tool_choice grammar."""
from __future__ import annotations

import json

import pytest

from specserve.entrypoints.openai import tool_calls
from specserve.entrypoints.openai.tool_call_stream import ToolCallStream, parse_whole
from specserve.entrypoints.openai.protocol import ChatCompletionRequest

NAMES = {"get_weather", "get_time"}
TWO_CALLS = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def request(**kw) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in sorted(NAMES)]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools, **kw})


def test_parse_takes_known_calls_and_leaves_the_rest():
    content, calls = tool_calls.parse(TWO_CALLS, NAMES)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2
    unknown = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    assert tool_calls.parse(unknown, NAMES) == (unknown, [])
    broken = '<tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>'
    assert tool_calls.parse(broken, NAMES) == (broken, [])
    assert tool_calls.parse("just text", NAMES) == ("just text", [])
    cut = '<tool_call>\n{"name": "get_time"'                           # cut by max_tokens: stays text
    assert tool_calls.parse(cut, NAMES) == (cut, [])


def streamed(text: str, step: int, blocks_are_calls: bool = True) -> tuple[str, list[dict]]:
    """Feed ``text`` in pieces of ``step`` characters -> (content, every delta.tool_calls entry)."""
    stream = ToolCallStream(NAMES)
    content, deltas = "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        out, new = stream.feed(piece, final=i == len(pieces) - 1)
        assert "<" not in out or not blocks_are_calls   # nothing of a call's block leaks into content
        content += out
        deltas += new
    return content, deltas


def assembled(deltas: list[dict]) -> list[tuple[str, str, str]]:
    """OpenAI's client-side assembly of streamed calls: (id, name, concatenated arguments) by index."""
    calls: dict[int, list] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["function"]["arguments"] == "" or "arguments" in d["function"]
            calls[d["index"]] = [d["id"], d["function"]["name"], d["function"]["arguments"]]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][2] += d["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 50])
def test_streaming_in_any_split_gives_the_whole_parse(step):
    content, deltas = streamed(TWO_CALLS, step)
    whole_content, whole_calls = tool_calls.parse(TWO_CALLS, NAMES)
    assert content.strip() == whole_content
    calls = assembled(deltas)
    assert [(name, json.loads(args)) for _, name, args in calls] == \
        [(c.name, json.loads(c.arguments)) for c in whole_calls]
    assert len({i for i, _, _ in calls}) == 2


BARE = ['{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        '  [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "arguments": "{}"}]',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}']
NOT_BARE = ['{"name": "launch", "arguments": {}}', '{"name": "get_time", "arguments": {}};; x', '{"name": "get_weather", "arguments": {"city": "Paris"}} and more',
            '```json\n{"a": 1}\n```', '[{"name": "get_weather", "arguments": {}}, {"name": "launch"}]', '{not json']


def test_an_answer_that_is_only_a_call_is_that_call():
    """Without blocks, a whole answer that is a call of a known function as JSON (bare or fenced:
    Llama 3.x's format, Qwen2.5-Coder-1.5B's habit) is a call; anything more or less stays text."""
    for text in BARE:
        content, calls = tool_calls.parse(text, NAMES)
        assert content is None and calls and calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert [c.name for c in tool_calls.parse(BARE[2], NAMES)[1]] == ["get_weather", "get_time"]
    assert [c.name for c in tool_calls.parse(BARE[5], NAMES)[1]] == ["get_weather", "get_time"]
    for text in NOT_BARE:
        assert tool_calls.parse(text, NAMES) == (text, [])


# starts as JSON, yet holds a block: its call, and the JSON before it stays content
JSON_THEN_BLOCK = '{"note": 1}\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


@pytest.mark.parametrize("step", [1, 3, 8, 500])
def test_a_streamed_bare_answer_gives_the_whole_parse(step):
    assert tool_calls.parse(JSON_THEN_BLOCK, NAMES)[0] == '{"note": 1}'
    for text in BARE + NOT_BARE + [JSON_THEN_BLOCK]:
        content, deltas = streamed(text, step, blocks_are_calls=False)
        whole_content, whole_calls = tool_calls.parse(text, NAMES)
        assert content == (whole_content or "")
        assert [(name, args) for _, name, args in assembled(deltas)] == [(c.name, c.arguments) for c in whole_calls]


def test_code_answers_still_stream_as_they_come():
    stream = ToolCallStream(NAMES)
    assert stream.feed("```py")[0] == "```py"          # not ```json: no reason to wait
    assert stream.feed("thon\nprint(1)\n```")[0] == "thon\nprint(1)\n```"


def test_arguments_stream_piece_by_piece_and_never_take_the_calls_closing_brace():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\" {", "n": [1, {"a": 2}]}}\n</tool_call>'
    content, deltas = streamed(text, 4)
    assert content == ""
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["index"] == 0
    assert len(deltas) > 5                                   # many argument pieces, not one
    (_, name, args), = assembled(deltas)
    assert json.loads(args) == {"city": 'Pa}ris " {', "n": [1, {"a": 2}]}
    assert args.endswith("}]}")


def test_blocks_that_cannot_stream_are_sent_whole():
    later_name = '<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>'
    _, deltas = streamed(later_name, 3)
    assert len(deltas) == 1 and deltas[0]["function"]["name"] == "get_time"
    unknown = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    content, deltas = streamed(unknown, 3, blocks_are_calls=False)
    assert deltas == [] and content == unknown


def test_streaming_text_that_only_looks_like_a_block_is_sent_at_the_end():
    stream = ToolCallStream(NAMES)
    assert stream.feed("a < b and <tool") == ("a < b and ", [])
    assert stream.feed("_c", final=True) == ("<tool_c", [])


def test_a_block_cut_before_it_became_a_call_is_text():
    stream = ToolCallStream(NAMES)
    cut = '<tool_call>\n{"name": "get_ti'
    assert stream.feed(cut, final=True) == (cut, [])


def test_conversation_without_template_tools_writes_the_format():
    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    req = request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
    ])
    messages, tools = tool_calls.conversation(req, Plain())
    assert tools is None
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    none_messages, _ = tool_calls.conversation(request(tool_choice="none"), Plain())
    assert [m["role"] for m in none_messages] == ["user"]


def test_conversation_with_template_tools_passes_them_and_decodes_arguments():
    class TakesTools:
        chat_template = "{% for t in tools %}{{ t }}{% endfor %}"

    req = request(messages=[{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}])
    messages, tools = tool_calls.conversation(req, TakesTools())
    assert [t["function"]["name"] for t in tools] == sorted(NAMES)
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


def test_the_constraint_by_tool_choice():
    assert tool_calls.constraint(request()) is None                                     # auto
    assert tool_calls.constraint(request(tool_choice="none")) is None
    several = tool_calls.constraint(request(tool_choice="required")).grammar
    assert several.startswith('start: call ("\\n" call)*') and "get_time" in several and "get_weather" in several
    one = tool_calls.constraint(request(tool_choice="required", parallel_tool_calls=False)).grammar
    assert one.startswith("start: call\n")
    named = tool_calls.constraint(request(tool_choice={"type": "function", "function": {"name": "get_time"}})).grammar
    assert "get_time" in named and "get_weather" not in named and named.startswith("start: call\n")


@pytest.mark.parametrize("step", [1, 2, 5, 13])
def test_a_whole_answer_and_its_stream_agree_even_when_cut(step):
    """The server reads a whole answer by the stream's rule fed at once (``parse_whole``): every
    prefix of an answer (cut anywhere by max_tokens) gives the same content, calls and arguments
    whole as streamed in any split. A block cut after its arguments began is a call in both."""
    texts = [TWO_CALLS[:n] for n in range(0, len(TWO_CALLS) + 1, 3)] + [TWO_CALLS] + BARE + NOT_BARE + [JSON_THEN_BLOCK]
    for text in texts:
        content, deltas = streamed(text, step, blocks_are_calls=False)
        whole_content, whole_calls = parse_whole(text, NAMES)
        assert content == (whole_content or ""), text
        assert [(name, args) for _, name, args in assembled(deltas)] == [(c.name, c.arguments) for c in whole_calls]
    content, calls = parse_whole(TWO_CALLS[:TWO_CALLS.index("CET") + 5], NAMES)     # the second block cut
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
