"""Anthropic's Messages API (``/v1/messages``) over the chat handler, driven by the real
``anthropic`` client on the tiny random model: answers equal the equivalent chat completion's,
streams are Anthropic's events, tools round-trip, errors and keys are Anthropic's."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from specserve import LLM
from specserve.entrypoints.openai.anthropic_answers import MessageEvents, message_body
from specserve.entrypoints.openai.anthropic_messages import MessagesRequest, to_chat
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.limits import APIError

from server_util import local_http, running_server, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
KEY = "s3cret"
GREEDY = {"extra_body": {"temperature": 0}}     # the current SDK sends no temperature of its own
TOOLS = [{"name": "get_weather", "description": "The weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                           "required": ["city"], "additionalProperties": False}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                                "parameters": TOOLS[0]["input_schema"]}}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def url(llm):
    with running_server(build_app(llm, MODEL, api_key=KEY)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


def chat(url, messages, **fields) -> dict:
    r = local_http.post(f"{url}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": MODEL, "messages": messages, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_answer_is_the_equivalent_chat_completion(client, url):
    m = client.messages.create(model=MODEL, max_tokens=8, system="Be brief.",
                               messages=[{"role": "user", "content": "Name a color."}], **GREEDY)
    want = chat(url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
                max_completion_tokens=8)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want["choices"][0]["message"]["content"]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (want["usage"]["prompt_tokens"], 8)
    assert m.stop_reason == "max_tokens" and m.role == "assistant" and m.id.startswith("msg")
    blocks = client.messages.create(model=MODEL, max_tokens=8, system=[{"type": "text", "text": "Be brief."}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}],
                                    **GREEDY)
    assert blocks.content[0].text == m.content[0].text


def test_a_stream_is_anthropics_events(client, url):
    kw = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hello"}], **GREEDY)
    whole = client.messages.create(**kw)
    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta"] * len(deltas) + [
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(deltas) == whole.content[0].text
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.usage.input_tokens == whole.usage.input_tokens


def test_tool_use_and_its_result(client, url):
    choice = {"type": "tool", "name": "get_weather"}
    kw = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              tool_choice=choice, **GREEDY)
    m = client.messages.create(**kw)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, TOOLS[0]["input_schema"])
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    # the call and its result sent back: the prompt the chat form of that conversation gives
    turn = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": m.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"},
                                         {"type": "text", "text": "And tomorrow?"}]}]
    again = client.messages.create(model=MODEL, max_tokens=4, messages=turn, tools=TOOLS, **GREEDY)
    chat_turn = [turn[0], {"role": "assistant", "content": None, "tool_calls": [
                     {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                 {"role": "tool", "tool_call_id": use.id, "content": "18 C"}, {"role": "user", "content": "And tomorrow?"}]
    want = chat(url, chat_turn, tools=CHAT_TOOLS, max_completion_tokens=4)
    assert again.usage.input_tokens == want["usage"]["prompt_tokens"]
    count = client.messages.count_tokens(model=MODEL, messages=turn, tools=TOOLS)
    assert count.input_tokens == want["usage"]["prompt_tokens"]


def test_stop_sequences_and_structured_output(client):
    seeded = {"extra_body": {"temperature": 1.0, "seed": 5}}      # varied text (greedy repeats newlines)
    free = client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Name a color."}],
                                  **seeded)
    text = free.content[0].text
    at = next(i for i in range(3, len(text) - 4) if text.find(text[i:i + 4]) == i and text[i:i + 4].strip())
    stop = text[at:at + 4]                       # first seen after some text
    m = client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Name a color."}],
                               stop_sequences=["never there", stop], **seeded)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == text[:at]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "A number."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert m.stop_reason == "end_turn"


def test_to_chat_builds_the_conversation():
    req = MessagesRequest(
        max_tokens=5, system="sys", tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 1024}, output_config={"effort": "low"},
        cache_control={"type": "ephemeral"}, metadata={"user_id": "u1"}, top_k=3,
        messages=[{"role": "user", "content": "q"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                                    {"type": "text", "text": "Let me look."},
                                                    {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                     "input": {"city": "Oslo"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                "content": [{"type": "text", "text": "down"}]}]}])
    body = to_chat(req)
    assert body["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: down"}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"] == CHAT_TOOLS and body["max_completion_tokens"] == 5 and body["top_k"] == 3
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["reasoning_effort"] == "low"
    assert body["user"] == "u1"
    named = to_chat(MessagesRequest(max_tokens=1, messages=[{"role": "user", "content": "q"}], tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("fields, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' blocks"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role must be user or assistant"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
    ({"container": "c1"}, "containers"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "max_model_len"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "a text block needs its text"),
    ({"messages": [{"role": "user", "content": [5]}]}, "must be a content block"),
    # errors of the chat request it becomes name the Messages API's fields
    ({"stop_sequences": [""]}, "stop_sequences: "),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}}, "output_config.format: "),
])
def test_what_is_refused_is_a_400_in_anthropics_shape(url, fields, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **fields}
    r = local_http.post(f"{url}/v1/messages", json={k: v for k, v in body.items() if v is not None}, timeout=60,
                        headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"], err


def test_keys_as_anthropics_clients_send_them(url, client):
    with pytest.raises(anthropic.AuthenticationError) as bad:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert bad.value.body["error"]["type"] == "authentication_error"
    r = local_http.post(f"{url}/v1/chat/completions", headers={"x-api-key": KEY}, timeout=60,
                        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 200          # the header any /v1 route takes, as the Bearer one


def test_reasoning_becomes_a_thinking_block(llm):
    """Under deepseek_r1 the tiny model's answer, which closes no tag, is all reasoning."""
    with running_server(build_app(llm, MODEL, reasoning_parser="deepseek_r1")) as url:
        c = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        kw = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "hi"}], **GREEDY)
        m = c.messages.create(**kw)
        assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
        events = list(c.messages.create(**kw, stream=True))
        pieces = [e.delta.thinking for e in events if e.type == "content_block_delta"]
        assert "".join(pieces) == m.content[0].thinking
        assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking"]


def test_leaving_a_stream_aborts_its_request(url, llm):
    with local_http.stream("POST", f"{url}/v1/messages", timeout=60, headers={"x-api-key": KEY},
                           json={"model": MODEL, "max_tokens": 400, "stream": True, "temperature": 0,
                                 "messages": [{"role": "user", "content": "x"}]}) as r:
        for line in r.iter_lines():
            if "text_delta" in line:
                break
    assert wait_until(lambda: not llm.engine.has_unfinished_requests(), timeout=30)


def test_events_of_text_then_calls_and_an_engine_error():
    import asyncio

    def run(chunks):
        async def source():
            for c in chunks:
                yield "data: " + json.dumps(c) + "\n\n"

        async def collect():
            return [e async for e in MessageEvents(MODEL).translate(source())]
        return [json.loads(e.split("\n")[1][len("data: "):]) for e in asyncio.run(collect())]

    def delta(**d):
        return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}

    events = run([delta(role="assistant", content=""), delta(content="Let me check."),
                  delta(tool_calls=[{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]),
                  delta(tool_calls=[{"index": 0, "function": {"arguments": "{\"x\": 1}"}}]),
                  delta(tool_calls=[{"index": 1, "id": "c2", "function": {"name": "g", "arguments": "{}"}}]),
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}])
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == [(0, "text"), (1, "tool_use"), (2, "tool_use")] and stops == [0, 1, 2]
    json_pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta"]
    assert json_pieces == ["{\"x\": 1}", "{}"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 9
    failed = run([delta(content="a"), {"error": {"message": "engine step failed", "code": "engine_error"}}])
    assert failed[-1] == {"type": "error", "error": {"type": "api_error", "message": "engine step failed"}}


def test_message_body_maps_the_finish():
    def answer(finish, stop_reason=None, **message):
        return {"model": MODEL, "choices": [{"message": {"role": "assistant", **message}, "finish_reason": finish,
                                             "stop_reason": stop_reason}]}

    assert message_body(answer("stop", content="a"), [])["stop_reason"] == "end_turn"
    assert message_body(answer("stop", 7, content="a"), [])["stop_reason"] == "end_turn"        # a stop token
    body = message_body(answer("stop", "END", content="a"), ["END"])
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    body = message_body(answer("tool_calls", content=None, tool_calls=[
        {"id": "c", "function": {"name": "f", "arguments": "{\"a\": [1]}"}}]), [])
    assert body["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": {"a": [1]}}]
    assert body["stop_reason"] == "tool_use"
    with pytest.raises(APIError):
        to_chat(MessagesRequest(max_tokens=1, messages=[{"role": "user", "content": [{"type": "document"}]}]))
