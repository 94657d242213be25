"""Structured output and tool calls through the server, with the real ``openai`` client:
response_format (json_object, json_schema), vLLM's structured_outputs and guided_* fields,
tools with tool_choice required / named / auto (streamed and not, parallel calls), and hostile
constraints (a 400 before any engine work, or "length") while other requests carry on.

The tiny random-weight model behind an n-gram proposer with forced-token drafts: it picks among
the allowed tokens almost at random, so every answer exercises the constraint, not the model.
"""
from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.limits import ServerLimits

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=1024, kv_cache_memory=32 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 6, "dynamic_k": False})
    app = build_app(llm, MODEL, limits=ServerLimits(max_structured_output_bytes=16 << 10))
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(model=MODEL, **kw)


def check_call(call, tools=TOOLS):
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


# ------------------------------------------------------------------------- response_format
def test_json_schema_response_format(client):
    for seed in range(3):
        out = chat(client, seed=seed, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_json_object_response_format_streamed(client):
    stream = chat(client, seed=5, max_tokens=400, stream=True, response_format={"type": "json_object"})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":           # any object: the random model may write keys until max_tokens
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.startswith("{")


def test_completions_take_response_format_too(client):
    out = client.completions.create(model=MODEL, prompt="A person: ", max_tokens=100, temperature=0,
                                    extra_body={"response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
    ("structured_outputs", {"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ("structured_outputs", {"grammar": 'root ::= "(" [0-9] [0-9]? ")"'}, lambda t: t[0] == "(" and t[-1] == ")"),
    ("structured_outputs", {"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
    ("guided_regex", "[A-Z]{4}", lambda t: len(t) == 4 and t.isupper()),
    ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("guided_grammar", 'start: "a" "a"? "b"', lambda t: t in ("ab", "aab")),
])
def test_vllm_extension_fields(client, field, value, check):
    out = chat(client, seed=1, max_tokens=60, extra_body={field: value})
    assert out.choices[0].finish_reason == "stop" and check(out.choices[0].message.content)


# ----------------------------------------------------------------------------------- tools
def test_tool_choice_required_gives_calls(client):
    out = chat(client, seed=2, tools=TOOLS, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)


def test_named_tool_choice_calls_that_function_once(client):
    for seed in range(3):
        out = chat(client, seed=seed, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == "get_time" and out.choices[0].finish_reason == "tool_calls"
        check_call(call)


def test_parallel_calls_streamed(client):
    """Several calls in one answer, each a delta.tool_calls entry with its index; the end of
    sequence is pushed down so that the random model goes on to a second call."""
    found = 0
    for seed in range(2):     # seed 0 makes ten calls, seed 1 one (when written)
        stream = chat(client, seed=seed, tools=TOOLS, tool_choice="required", stream=True, logit_bias={"2": -2},
                      max_tokens=400)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        if finish != "tool_calls":
            continue
        assert sorted(calls) == list(range(len(calls)))
        for entry in calls.values():
            spec = next(t["function"] for t in TOOLS if t["function"]["name"] == entry["name"])
            jsonschema.validate(json.loads(entry["arguments"]), spec["parameters"])
        found = max(found, len(calls))
    assert found >= 2


def test_parallel_tool_calls_false_gives_one_call(client):
    out = chat(client, seed=0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, logit_bias={"2": -8})
    assert len(out.choices[0].message.tool_calls) == 1


def test_auto_parses_calls_out_of_the_text(client):
    """tool_choice auto: whatever the model writes; blocks holding a known function's call become
    tool_calls. The random model is steered into writing one by a grammar of text then a block."""
    grammar = ('start: "Let me check.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
               '{\\"city\\": \\"" CITY "\\", \\"unit\\": \\"C\\"}}\\n</tool_call>"\nCITY: "Paris" | "Rome"')
    out = chat(client, seed=0, tools=TOOLS, tool_choice="auto", extra_body={"structured_outputs": {"grammar": grammar}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"   # as written
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    stream = chat(client, seed=0, tools=TOOLS, stream=True, extra_body={"structured_outputs": {"grammar": grammar}})
    content, pieces, finish = "", [], None
    for chunk in stream:
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            pieces += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert content == choice.message.content and finish == "tool_calls"
    assert {p.index for p in pieces} == {0} and pieces[0].id and pieces[0].function.name == "get_weather"
    assert len(pieces) > 2                                 # the arguments came piece by piece
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(arguments) == json.loads(call.function.arguments)


def test_auto_without_a_call_is_plain_content(client):
    out = chat(client, seed=3, max_tokens=12, tools=TOOLS)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)


def test_earlier_calls_and_results_go_into_the_prompt(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    out = chat(client, messages=messages, tools=TOOLS, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.prompt_tokens > 100


# ------------------------------------------------------------------------------- hostile input
def post(server, body, path="/v1/chat/completions"):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 20, **body}
    return local_http.post(f"{server}{path}", json=body, timeout=60)


@pytest.mark.parametrize("body, param, code", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "invalid_structured_output"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid_structured_output"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "invalid_structured_output"),
    ({"structured_outputs": {"regex": "a{1000}{1000}"}}, "structured_outputs", "structured_output_too_complex"),
    ({"guided_json": {"type": "object", "properties": {f"key_{i}": {"type": "integer"} for i in range(30000)}}},
     "guided_json", "structured_output_too_large"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "invalid_value"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "invalid_value"),
])
def test_bad_constraints_are_a_400_naming_the_problem(server, body, param, code):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err


def test_a_one_megabyte_schema_is_refused_at_once(server):
    schema = {"type": "object", "properties": {f"k{i}_{'x' * 40}": {"type": "string"} for i in range(20000)}}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
    assert len(json.dumps(body)) > 1 << 20
    r = post(server, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "structured_output_too_large"


def test_tool_choice_checks(server):
    assert post(server, {"tool_choice": "required"}).status_code == 400                    # no tools
    r = post(server, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def test_a_grammar_that_never_ends_is_refused(server):
    """No finite derivation ("a" forever): its parser state grows with every token, past the
    grammar limits within the first tokens compiling walks."""
    r = post(server, {"guided_grammar": 'root ::= "a" root'})
    assert r.status_code == 400 and r.json()["error"]["code"] == "structured_output_too_complex"
    assert "<" not in r.json()["error"]["message"]          # llguidance's appended state is cut


def test_a_constraint_that_cannot_finish_stops_at_length_while_others_carry_on(server, client):
    """The end of sequence banned: "ab" repeats until max_tokens; a request beside it is served."""
    results = {}

    def endless():
        results["endless"] = post(server, {"guided_grammar": 'start: "ab"+', "logit_bias": {"2": -100},
                                           "max_tokens": 150}).json()

    thread = threading.Thread(target=endless)
    thread.start()
    normal = chat(client, seed=4, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    thread.join(timeout=120)
    endless_choice = results["endless"]["choices"][0]
    assert endless_choice["finish_reason"] == "length" and set(endless_choice["message"]["content"]) == {"a", "b"}
    assert normal.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(normal.choices[0].message.content), PERSON)
