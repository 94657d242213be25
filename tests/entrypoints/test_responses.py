"""OpenAI's Responses API (``/v1/responses``, ``openai/responses.py``) through the real OpenAI client:
the same answer as the equivalent chat completion, streamed as the Responses events, with
function calls, structured output, multi-turn tool results, and clear 400s for what is not
supported. Tiny random model, greedy."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.reasoning import PARSERS
from specserve.entrypoints.openai.response_answers import AnswerLogprobs
from specserve.entrypoints.openai.limits import APIError
from specserve.entrypoints.openai.responses import ResponsesRequest, to_chat

from server_util import local_http, running_server, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def url(llm):
    with running_server(build_app(llm, MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(url, messages, **fields) -> dict:
    r = local_http.post(f"{url}/v1/chat/completions", timeout=60,
                        json={"model": MODEL, "messages": messages, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_answer_is_the_equivalent_chat_completions(client, url):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a color.", max_output_tokens=8,
                                temperature=0, metadata={"run": "1"})
    want = chat(url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
                max_completion_tokens=8)
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want["usage"]["prompt_tokens"],
                                                             want["usage"]["completion_tokens"])
    assert r.status == ("incomplete" if want["choices"][0]["finish_reason"] == "length" else "completed")
    assert r.metadata == {"run": "1"} and r.instructions == "Be brief." and r.store is True
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"


def test_a_stream_is_the_responses_events(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
              max_output_tokens=6, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"])      # 6 tokens: max_output_tokens ends it
    final = events[-1].response
    assert "".join(deltas) == events[-4].text == final.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == 6
    assert final.incomplete_details.reason == "max_output_tokens"


def test_function_calls_and_their_results(client, url):
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice=named,
                                max_output_tokens=60, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice=named,
                                          max_output_tokens=60, temperature=0, stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == call.arguments
    # the call and its result sent back as input: the prompt the chat form of that conversation gives
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    again = client.responses.create(model=MODEL, input=turn, tools=TOOLS, max_output_tokens=4, temperature=0)
    chat_turn = [turn[0], {"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
                 {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}]
    want = chat(url, chat_turn, tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
                max_completion_tokens=4)
    assert again.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert again.output_text == (want["choices"][0]["message"]["content"] or "")


def test_text_format_json_schema(client):
    r = client.responses.create(model=MODEL, input="A person.", max_output_tokens=200, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


@pytest.mark.parametrize("fields, param", [
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": 5}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": "word " * 600}, "input"),                      # longer than max_model_len
])
def test_what_is_not_supported_is_a_400_naming_the_field(url, fields, param):
    r = local_http.post(f"{url}/v1/responses", json={"model": MODEL, "input": "x", **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_to_chat_builds_the_conversation():
    req = ResponsesRequest(instructions="sys", input=[
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}],
        max_output_tokens=5, tool_choice={"type": "function", "name": "f"}, tools=[{"type": "function", "name": "f"}],
        text={"format": {"type": "json_object"}})
    body, conversation = to_chat(req)
    assert conversation == body["messages"][1:]         # without the instructions
    assert body["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "developer", "content": "dev"},
        {"role": "assistant", "content": "ab", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"}, {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert body["max_completion_tokens"] == 5 and body["response_format"] == {"type": "json_object"}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["tools"] == [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(APIError, match="no message"):
        to_chat(ResponsesRequest(input=[]))
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "answer"}]
    body, conversation = to_chat(ResponsesRequest(instructions="new", input="next"), history)
    assert body["messages"] == [{"role": "system", "content": "new"}, *history, {"role": "user", "content": "next"}]


def test_leaving_a_stream_aborts_its_request(url, llm):
    with local_http.stream("POST", f"{url}/v1/responses", timeout=60,
                           json={"model": MODEL, "input": "x", "max_output_tokens": 400, "stream": True,
                                 "temperature": 0}) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break
    assert wait_until(lambda: not llm.engine.has_unfinished_requests(), timeout=30)


def events_of(chunks: list[dict], req: ResponsesRequest | None = None, **kw) -> list[dict]:
    import asyncio

    from specserve.entrypoints.openai.response_answers import ResponseEvents

    async def source():
        for c in chunks:
            yield "data: " + json.dumps(c) + "\n\n"
        yield "data: [DONE]\n\n"

    async def run():
        return [e async for e in ResponseEvents(req or ResponsesRequest(input="x"), MODEL, **kw).translate(source())]

    out = []
    for text in asyncio.run(run()):
        kind, data = text.strip().split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        out.append(json.loads(data[len("data: "):]))
        assert out[-1]["type"] == kind[len("event: "):]
    return out


def test_text_then_calls_then_text_become_items_in_order():
    def delta(**d):
        return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}

    chunks = [delta(role="assistant", content=""), delta(content="Let me "), delta(content="check."),
              delta(tool_calls=[{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]),
              delta(tool_calls=[{"index": 0, "function": {"arguments": "{\"x\": "}}]),
              delta(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
              delta(tool_calls=[{"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]),
              delta(content=" Done."),
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}]
    events = events_of(chunks)
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["status"] == "completed"
    output = final["response"]["output"]
    assert [(o["type"], o.get("name"), o.get("arguments")) for o in output] == [
        ("message", None, None), ("function_call", "f", "{\"x\": 1}"), ("function_call", "g", "{}"), ("message", None, None)]
    assert [o["content"][0]["text"] for o in output if o["type"] == "message"] == ["Let me check.", " Done."]
    assert [o["call_id"] for o in output if o["type"] == "function_call"] == ["call_a", "call_b"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    assert final["response"]["usage"]["total_tokens"] == 12


def test_an_error_in_the_stream_fails_the_response():
    chunks = [{"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]},
              {"error": {"message": "engine step failed", "type": "server_error", "code": "engine_error"}}]
    events = events_of(chunks)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "engine_error"


def test_kept_responses_continue_read_and_delete(client, url):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a color.",
                                    max_output_tokens=5, temperature=0)
    assert first.store is True
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, input="And another?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    assert second.previous_response_id == first.id
    # the conversation goes on from the first one's, its instructions not carried over
    want = chat(url, [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "And another?"}], max_completion_tokens=5)
    assert second.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert second.output_text == want["choices"][0]["message"]["content"]
    streamed = list(client.responses.create(model=MODEL, input="More?", previous_response_id=second.id,
                                            max_output_tokens=3, temperature=0, stream=True))[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    assert local_http.delete(f"{url}/v1/responses/{first.id}", timeout=30).json()["deleted"] is True
    for path in (f"/v1/responses/{first.id}",):
        assert local_http.get(f"{url}{path}", timeout=30).status_code == 404
    gone = local_http.post(f"{url}/v1/responses", timeout=30,
                           json={"model": MODEL, "input": "x", "previous_response_id": first.id})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"


def test_store_false_and_the_bound(llm):
    with running_server(build_app(llm, MODEL, max_stored_responses=2)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        unkept = c.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
        assert unkept.store is False
        assert local_http.get(f"{base}/v1/responses/{unkept.id}", timeout=30).status_code == 404
        ids = [c.responses.create(model=MODEL, input="x", max_output_tokens=2).id for _ in range(3)]
        found = [local_http.get(f"{base}/v1/responses/{i}", timeout=30).status_code for i in ids]
        assert found == [404, 200, 200]            # the least recently used went first


def test_metrics_count_responses_under_their_own_endpoint(client, url):
    def count() -> float:
        for line in local_http.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith("specserve_requests_total{") and 'endpoint="responses"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count()
    client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    assert count() == before + 1


def test_include_of_encrypted_reasoning_adds_nothing(client):
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=2, include=["reasoning.encrypted_content"],
                                store=False)
    assert r.status in ("completed", "incomplete")


def test_cached_prompt_tokens_are_reported(client, url):
    """The prefix cache's hits: the first time a prompt is seen only what it shares with earlier
    prompts (the chat template's start), all its whole blocks when it is sent again
    (usage.prompt_tokens_details / input_tokens_details.cached_tokens)."""
    words = "cached prefix probe " * 12
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 2, "temperature": 0}
    first = local_http.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    again = local_http.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"] - 16
    assert again["prompt_tokens"] - 16 <= cached < again["prompt_tokens"] and cached % 16 == 0
    r = client.responses.create(model=MODEL, input=words, max_output_tokens=2, temperature=0)
    assert r.usage.input_tokens_details.cached_tokens == cached


def test_logprobs_of_the_answer_whole_and_streamed(client, url):
    """include message.output_text.logprobs: the chat completion's logprobs on the output_text
    part, the same entries spread over the stream's deltas; top_logprobs alternatives too."""
    kw = dict(model=MODEL, input="Name a color.", max_output_tokens=8, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    whole = client.responses.create(**kw).model_dump()
    want = chat(url, [{"role": "user", "content": "Name a color."}], max_completion_tokens=8, logprobs=True,
                top_logprobs=2)["choices"][0]["logprobs"]["content"]
    part = whole["output"][0]["content"][0]

    def same(entries) -> bool:       # equal tokens; log-probabilities equal to float noise (the prefix cache)
        def flat(es):
            return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in es]

        def values(es):
            return [v for e in es for v in [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]]
        return flat(entries) == flat(want) and values(entries) == pytest.approx(values(want), abs=1e-4)

    assert len(want) == 8 and same(part["logprobs"])
    assert all(len(e["top_logprobs"]) == 2 for e in part["logprobs"])
    events = [e.model_dump() for e in client.responses.create(**kw, stream=True)]
    streamed = [entry for e in events if e["type"] == "response.output_text.delta" for entry in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert streamed == done["logprobs"] == events[-1]["response"]["output"][0]["content"][0]["logprobs"]
    assert same(streamed)
    plain = local_http.post(f"{url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": "Name a color.", "max_output_tokens": 8, "temperature": 0}).json()
    assert "logprobs" not in plain["output"][0]["content"][0]          # not asked for


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_answer_logprobs_leave_the_reasoning_out(parser):
    """The answer's entries start after the token that completes </think>, fed whole or a few at
    a time (as a stream's chunks come), and none are handed out while the reasoning may go on."""
    tokens = (["<think>"] if parser == "qwen3" else []) + ["17", " *", " 23", "</", "think", ">", "\n", "391"]
    entries = [{"token": t, "logprob": -0.1 * i} for i, t in enumerate(tokens)]
    whole = AnswerLogprobs(PARSERS[parser])
    whole.add(entries)
    assert whole.answer() == entries[-2:]
    for cut in range(1, len(entries)):
        stream = AnswerLogprobs(PARSERS[parser])
        got = []
        for a in range(0, len(entries), cut):
            stream.add(entries[a:a + cut])
            got += stream.take()
        assert got == stream.answer() == entries[-2:], cut
    unthinking = AnswerLogprobs(PARSERS["qwen3"])
    unthinking.add([{"token": "<", "logprob": 0.0}])
    assert unthinking.take() == []                       # "<" may begin <think>: undecided
    unthinking.add([{"token": "b>bold", "logprob": 0.0}])
    assert len(unthinking.take()) == 2 and AnswerLogprobs(None).answer() == []


def test_the_logprobs_of_tokens_without_text_are_streamed_too():
    """The end of sequence shows no text: its entry comes in a delta of no text before the done
    event, so the deltas' entries join to the done event's (the whole answer's)."""
    def entry(token):
        return {"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top_logprobs": []}

    chunks = [{"choices": [{"index": 0, "delta": {"content": "Paris"}, "logprobs": {"content": [entry("Paris")]},
                            "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [entry("<|im_end|>")]},
                            "finish_reason": "stop"}]}]
    events = events_of(chunks, logprobs=True)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [d["delta"] for d in deltas] == ["Paris", ""]
    assert [x for d in deltas for x in d["logprobs"]] == done["logprobs"] == [entry("Paris"), entry("<|im_end|>")]
