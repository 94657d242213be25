"""Hostile and careless clients against the real HTTP server.

A real uvicorn server on loopback over a tiny random model (seconds, not the
default model). Every case asserts its status, OpenAI's error shape, and that a
well-formed greedy stream running at the same moment completes with the same
text as alone. Then HTTP-level garbage over raw sockets, a client gone
mid-upload (quiet: no log, no 500), a slow body (408), slow and oversized
request heads (408 or 431, then closed), tokenization off the engine thread,
and a disconnect storm of 64 streams with and without speculation.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import threading
import time

import httpx
import pytest

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.limits import ServerLimits

from server_util import local_http, running_server, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
LIMITS = ServerLimits(max_body_bytes=256 << 10, body_timeout_s=1.5, header_timeout_s=1.0, max_header_bytes=16 << 10,
                      max_json_depth=32, max_prompts=8)
WITNESS = {"model": MODEL, "prompt": "The witness request says", "max_tokens": 16, "temperature": 0,
           "ignore_eos": True, "stream": True}
ANY = object()


def make_llm(model_dir, spec: bool) -> LLM:
    extra = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if spec else {}
    return LLM(model=model_dir, dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, **extra)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, spec=False)


@pytest.fixture(scope="module")
def server(llm):
    app = build_app(llm, MODEL, limits=LIMITS)
    with running_server(app) as base:
        yield base, app
    app.state.async_engine.shutdown()


@pytest.fixture(scope="module")
def base(server):
    return server[0]


def idle(llm) -> bool:
    e = llm.engine
    return not e.has_unfinished_requests() and e.kv_cache.num_free_blocks == e.kv_cache.num_blocks


def stream_text(base: str, body: dict, first_chunk: threading.Event | None = None) -> str:
    """The concatenated text of a streamed completion; fails on an error event."""
    text = []
    with local_http.Client(timeout=60) as http, http.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            if first_chunk is not None:
                first_chunk.set()
    return "".join(text)


@pytest.fixture(scope="module")
def witness_alone(base):
    return stream_text(base, WITNESS)


def with_witness(base: str, expected: str, send):
    """Run ``send()`` while the witness stream is running; the witness must be unharmed."""
    started, result = threading.Event(), {}

    def run():
        try:
            result["text"] = stream_text(base, WITNESS, started)
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e
            started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    try:
        return send()
    finally:
        thread.join(60)
        assert "error" not in result, result.get("error")
        assert result["text"] == expected


def every_nth_fast(cases: list[tuple], n: int) -> list:
    """pytest params of ``cases`` (ids from their first field): every n-th in the fast tier, the
    others marked slow. The full suite runs them all; the fast tier a spread of each kind."""
    return [pytest.param(c, id=c[0], marks=() if i % n == 0 else pytest.mark.slow) for i, c in enumerate(cases)]


def assert_error_shape(r: httpx.Response, status: int, param=ANY, code=ANY) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] is None or isinstance(err["code"], str)
    if param is not ANY:
        assert err["param"] == param or (param is not None and str(err["param"]).startswith(param)), err
    if code is not ANY:
        assert err["code"] == code, err
    return err


# ------------------------------------------------------------------ the cases
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
TOO_LONG = "hello " * 300


def comp(**fields):
    return {"model": MODEL, "prompt": "x", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **fields}


def nested(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


# (id, path, body: dict or raw JSON bytes, status, param, code)
CASES = [
    # found by hostile-client testing
    ("top_k_1e20", C, comp(top_k=10**20), 400, "top_k", ANY),
    ("surrogate_prompt", C, b'{"model": "tiny", "prompt": "\\ud800 x", "max_tokens": 4}', 400, "prompt", "invalid_unicode"),
    ("surrogate_chat", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages[0].content", "invalid_unicode"),
    ("deep_nesting_recursion", C, b"[" * 100_000, 400, ANY, "invalid_json"),
    ("deep_nesting_33", C, nested(33), 400, "prompt", "invalid_json"),
    ("temperature_NaN", C, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, None, "invalid_json"),
    ("temperature_Infinity", C, b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', 400, None, "invalid_json"),
    ("top_p_-Infinity", C, b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}', 400, None, "invalid_json"),
    ("temperature_1e400", C, b'{"model": "tiny", "prompt": "x", "temperature": 1e400}', 400, "temperature", "invalid_json"),
    ("seed_1e30", C, comp(seed=10**30), 400, "seed", ANY),
    ("seed_2_64", C, comp(seed=2**64), 400, "seed", ANY),
    ("seed_negative", C, comp(seed=-2**63 - 1), 400, "seed", ANY),
    ("seed_2_64_greedy", C, comp(seed=2**64, temperature=0), 400, "seed", ANY),
    ("seed_minus_one", C, comp(seed=-1), 400, "seed", ANY),
    ("unknown_model", C, comp(model="gpt-4"), 404, "model", "model_not_found"),
    ("unknown_model_chat", CHAT, chat(model="nope"), 404, "model", "model_not_found"),
    ("too_many_prompts", C, comp(prompt=["a"] * 9), 400, "prompt", "too_many_prompts"),
    # surrogates elsewhere
    ("surrogate_low", C, b'{"model": "tiny", "prompt": "a\\udc00", "max_tokens": 4}', 400, "prompt", "invalid_unicode"),
    ("surrogate_reversed_pair", C, b'{"model": "tiny", "prompt": "\\udc00\\ud800"}', 400, "prompt", "invalid_unicode"),
    ("surrogate_in_batch", C, b'{"model": "tiny", "prompt": ["ok", "\\ud83d"]}', 400, "prompt[1]", "invalid_unicode"),
    ("surrogate_stop", C, b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', 400, "stop[0]", "invalid_unicode"),
    ("surrogate_key", C, b'{"model": "tiny", "prompt": "x", "\\ud800": 1}', 400, None, "invalid_unicode"),
    ("surrogate_model", C, b'{"model": "\\udfff", "prompt": "x"}', 400, "model", "invalid_unicode"),
    ("surrogate_message_extra", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}',
     400, "messages[0].name", "invalid_unicode"),
    ("surrogate_content_part", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', 400,
     "messages[0].content[0].text", "invalid_unicode"),
    # JSON shape
    ("malformed_json", C, b'{"model": "tiny", "prompt": "x",', 400, None, "invalid_json"),
    ("empty_body", C, b"", 400, None, "invalid_json"),
    ("top_level_array", C, b"[1, 2]", 400, None, "invalid_json"),
    ("top_level_string", C, b'"prompt"', 400, None, "invalid_json"),
    ("top_level_null", C, b"null", 400, None, "invalid_json"),
    ("invalid_utf8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, "invalid_json"),
    ("nested_message_extra", CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x", "meta": json.loads("[" * 40 + "]" * 40)}]}).encode(), 400, "messages[0].meta",
     "invalid_json"),
    ("deep_dict", C, b'{"model": "tiny", "prompt": "x", "user": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}", 400, "user",
     "invalid_json"),
    # ranges and types of the sampling fields
    ("top_k_minus_two", C, comp(top_k=-2), 400, "top_k", ANY),
    ("top_k_2_31", C, comp(top_k=2**31), 400, "top_k", ANY),
    ("top_k_above_vocab", C, comp(top_k=49153), 400, "top_k", "invalid_value"),
    ("top_k_float", C, comp(top_k=5.0), 400, "top_k", ANY),
    ("top_k_string", C, comp(top_k="5"), 400, "top_k", ANY),
    ("seed_float", C, comp(seed=1.5), 400, "seed", ANY),
    ("seed_string", C, comp(seed="1"), 400, "seed", ANY),
    ("seed_bool", C, comp(seed=True), 400, "seed", ANY),
    ("temperature_string", C, comp(temperature="hot"), 400, "temperature", ANY),
    ("temperature_bool", C, comp(temperature=True), 400, "temperature", ANY),
    ("temperature_negative", C, comp(temperature=-0.5), 400, "temperature", ANY),
    ("temperature_list", C, comp(temperature=[1]), 400, "temperature", ANY),
    ("top_p_zero", C, comp(top_p=0), 400, "top_p", ANY),
    ("top_p_above_one", C, comp(top_p=1.5), 400, "top_p", ANY),
    ("top_p_string", C, comp(top_p="0.5"), 400, "top_p", ANY),
    ("min_p_two", C, comp(min_p=2), 400, "min_p", ANY),
    ("min_p_negative", C, comp(min_p=-0.1), 400, "min_p", ANY),
    ("max_tokens_zero", C, comp(max_tokens=0), 400, "max_tokens", ANY),
    ("max_tokens_negative", C, comp(max_tokens=-3), 400, "max_tokens", ANY),
    ("max_tokens_string", C, comp(max_tokens="8"), 400, "max_tokens", ANY),
    ("max_tokens_float", C, comp(max_tokens=8.5), 400, "max_tokens", ANY),
    ("max_tokens_bool", C, comp(max_tokens=True), 400, "max_tokens", ANY),
    ("stop_token_ids_strings", C, comp(stop_token_ids=["a"]), 400, "stop_token_ids", ANY),
    ("stop_token_ids_negative", C, comp(stop_token_ids=[-1]), 400, "stop_token_ids", ANY),
    ("stop_token_ids_bool", C, comp(stop_token_ids=[True]), 400, "stop_token_ids", ANY),
    ("stop_token_ids_scalar", C, comp(stop_token_ids=5), 400, "stop_token_ids", ANY),
    ("stop_token_ids_float", C, comp(stop_token_ids=[1.5]), 400, "stop_token_ids", ANY),
    ("stop_token_ids_above_vocab", C, comp(stop_token_ids=[49152]), 400, "stop_token_ids", "invalid_value"),
    ("stop_token_ids_huge", C, comp(stop_token_ids=[10**30]), 400, "stop_token_ids", ANY),
    ("logprobs_bool", C, comp(logprobs=True), 400, "logprobs", ANY),
    ("logprobs_21", C, comp(logprobs=21), 400, "logprobs", ANY),
    ("logprobs_negative", C, comp(logprobs=-1), 400, "logprobs", ANY),
    ("logprobs_string", C, comp(logprobs="2"), 400, "logprobs", ANY),
    ("chat_logprobs_int", CHAT, chat(logprobs=3), 400, "logprobs", ANY),
    ("chat_top_logprobs_21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", ANY),
    ("chat_top_logprobs_alone", CHAT, chat(top_logprobs=2), 400, ANY, ANY),
    ("n_too_many", C, comp(n=129), 400, "n", ANY),
    ("n_zero", C, comp(n=0), 400, "n", ANY),
    ("n_bool", C, comp(n=True), 400, "n", ANY),
    ("best_of", C, comp(best_of=2), 400, "best_of", ANY),
    ("echo_string", C, comp(echo="yes"), 400, "echo", ANY),
    ("echo_with_beam_search", C, comp(echo=True, use_beam_search=True, best_of=2), 400, ANY, ANY),
    ("prompt_logprobs_21", C, comp(prompt_logprobs=21), 400, "prompt_logprobs", ANY),
    ("prompt_logprobs_negative", CHAT, chat(prompt_logprobs=-1), 400, "prompt_logprobs", ANY),
    ("prompt_logprobs_streamed", C, comp(prompt_logprobs=1, stream=True), 400, "prompt_logprobs", ANY),
    ("suffix", C, comp(suffix="x"), 400, "suffix", ANY),
    ("logit_bias_key", C, comp(logit_bias={"x1": 5}), 400, "logit_bias", ANY),
    ("logit_bias_vocab", C, comp(logit_bias={"99999999": 5}), 400, "logit_bias", ANY),
    ("presence_penalty", C, comp(presence_penalty=2.5), 400, "presence_penalty", ANY),
    ("repetition_penalty", C, comp(repetition_penalty=-1), 400, "repetition_penalty", ANY),
    ("frequency_penalty_nan", C, b'{"model": "tiny", "prompt": "x", "frequency_penalty": NaN}', 400, None, "invalid_json"),
    ("stop_empty", C, comp(stop=""), 400, "stop", ANY),
    ("stop_int", C, comp(stop=[1]), 400, "stop", ANY),
    ("stop_seventeen", C, comp(stop=[str(i) for i in range(17)]), 400, "stop", ANY),
    ("stream_string", C, comp(stream="yes"), 400, "stream", ANY),
    ("stream_options_unknown", C, comp(stream=True, stream_options={"bogus": 1}), 400, "stream_options", ANY),
    ("stream_options_string", C, comp(stream_options="x"), 400, "stream_options", ANY),
    ("ignore_eos_string", C, comp(ignore_eos="true"), 400, "ignore_eos", ANY),
    ("unknown_field", C, comp(bogus_field=1), 400, "bogus_field", "extra_forbidden"),
    ("model_int", C, comp(model=42), 400, "model", ANY),
    # prompts
    ("prompt_int", C, comp(prompt=42), 400, "prompt", ANY),
    ("prompt_empty_list", C, comp(prompt=[]), 400, "prompt", ANY),
    ("prompt_mixed", C, comp(prompt=[1, "a"]), 400, "prompt", ANY),
    ("prompt_empty_inner", C, comp(prompt=[[]]), 400, "prompt", ANY),
    ("prompt_ragged", C, comp(prompt=[[1], [2, "x"]]), 400, "prompt", ANY),
    ("prompt_object", C, comp(prompt={"a": 1}), 400, "prompt", ANY),
    ("prompt_null", C, comp(prompt=None), 400, "prompt", ANY),
    ("prompt_bool", C, comp(prompt=True), 400, "prompt", ANY),
    ("prompt_bool_ids", C, comp(prompt=[True, False]), 400, "prompt", ANY),
    ("prompt_missing", C, {"model": MODEL}, 400, "prompt", ANY),
    ("prompt_token_out_of_vocab", C, comp(prompt=[10**9]), 400, "prompt", "invalid_prompt"),
    ("prompt_token_negative", C, comp(prompt=[-1]), 400, "prompt", "invalid_prompt"),
    ("prompt_token_huge", C, comp(prompt=[10**30]), 400, "prompt", "invalid_prompt"),
    ("prompt_empty_string", C, comp(prompt=""), 400, "prompt", "invalid_prompt"),
    ("prompt_too_long", C, comp(prompt=TOO_LONG), 400, "prompt", "invalid_prompt"),
    ("prompt_too_long_in_batch", C, comp(prompt=["fine", TOO_LONG]), 400, "prompt", "invalid_prompt"),
    ("prompt_too_long_stream", C, comp(prompt=TOO_LONG, stream=True), 400, "prompt", "invalid_prompt"),
    # chat messages
    ("messages_empty", CHAT, chat(messages=[]), 400, "messages", ANY),
    ("messages_string", CHAT, chat(messages="hi"), 400, "messages", ANY),
    ("messages_role_unknown", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role", ANY),
    ("messages_no_role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role", ANY),
    ("messages_content_int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", ANY),
    ("messages_image_part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content", ANY),
    ("messages_text_part_without_text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages[0].content", ANY),
    ("messages_null_entry", CHAT, chat(messages=[None]), 400, "messages[0]", ANY),
    ("chat_max_completion_tokens_zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", ANY),
    ("chat_too_long", CHAT, chat(messages=[{"role": "user", "content": TOO_LONG}]), 400, "messages", "invalid_prompt"),
    ("chat_seed_2_64", CHAT, chat(seed=2**64), 400, "seed", ANY),
]


@pytest.mark.parametrize("case", every_nth_fast(CASES, 3))
def test_hostile_request_gets_a_clear_4xx_and_a_concurrent_stream_is_unharmed(base, witness_alone, case):
    _, path, body, status, param, code = case
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"Content-Type": "application/json"}}
    else:
        kw = {"json": body}
    r = with_witness(base, witness_alone, lambda: local_http.post(f"{base}{path}", timeout=60, **kw))
    assert_error_shape(r, status, param, code)


def test_there_are_many_cases():
    assert len(CASES) >= 100


# ---------------------------------------------------------------- media type and size
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_post_bodies_must_be_application_json(base, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = local_http.post(f"{base}/v1/completions", content=json.dumps(comp()).encode(), headers=headers)
    assert_error_shape(r, 415, None, "unsupported_media_type")


def test_application_json_with_a_charset_is_fine(base):
    r = local_http.post(f"{base}/v1/completions", content=json.dumps(comp(temperature=0)).encode(),
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_a_body_over_the_limit_is_413_at_once(base, witness_alone):
    big = json.dumps(comp(prompt="ab " * 200_000)).encode()            # 600 KB > 256 KiB
    t0 = time.monotonic()
    r = with_witness(base, witness_alone, lambda: local_http.post(f"{base}/v1/completions", content=big,
                                                             headers={"Content-Type": "application/json"}))
    assert_error_shape(r, 413, None, "request_too_large")
    assert time.monotonic() - t0 < 30


def test_a_chunked_body_over_the_limit_is_413(base):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"a" * 4096
        yield b'"}'

    r = local_http.post(f"{base}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error_shape(r, 413, None, "request_too_large")


def test_a_body_just_under_the_limit_is_served(base):
    body = json.dumps(comp(prompt=[1] * 3, user="u" * (LIMITS.max_body_bytes - 200), temperature=0)).encode()
    assert len(body) < LIMITS.max_body_bytes
    r = local_http.post(f"{base}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:300]


def test_wrong_method_and_unknown_route_have_the_error_shape(base):
    r = local_http.get(f"{base}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = local_http.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------- raw sockets
def raw_exchange(base: str, data: bytes, wait: float = 5.0, close_after_send: bool = False) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        if close_after_send:
            return b""
        s.shutdown(socket.SHUT_WR) if not data.endswith(b"\r\n\r\n") or b"Content-Length" in data else None
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except socket.timeout:
            pass
        return out


def http_request(body: bytes, headers: str = "", path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n").encode() + body


RAW_CASES = [
    ("garbage_request_line", b"HELLO WORLD\r\n\r\n", (400,)),
    ("binary_garbage", bytes(range(256)) + b"\r\n\r\n", (400,)),
    ("bad_content_length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", (400,)),
    ("negative_content_length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}", (400,)),
    ("two_content_lengths", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     (400,)),
    ("huge_header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", (431,)),
    ("bad_chunked_encoding", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n", (400,)),
    ("declared_length_over_limit", http_request(b"{}", ).replace(b"Content-Length: 2", b"Content-Length: 999999999"),
     (413,)),
    ("unknown_method", b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", (405,)),
    ("http10_no_host", b"GET /health HTTP/1.0\r\n\r\n", (200,)),
]


@pytest.mark.parametrize("case", every_nth_fast(RAW_CASES, 3))
def test_http_level_garbage_is_rejected_and_the_server_carries_on(base, witness_alone, case):
    _, data, statuses = case
    out = with_witness(base, witness_alone, lambda: raw_exchange(base, data))
    status_line = out.split(b"\r\n", 1)[0]
    assert any(status_line.startswith(f"HTTP/1.1 {s}".encode()) or status_line.startswith(f"HTTP/1.0 {s}".encode())
               for s in statuses), out[:300]
    assert local_http.get(f"{base}/health").status_code == 200


def test_pipelined_requests_are_answered_in_order(base):
    one = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    out = raw_exchange(base, one + one + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200") == 3


def _metric(base: str, name: str, label: str) -> float:
    text = local_http.get(f"{base}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


@pytest.fixture
def server_logs(caplog):
    """Every record the server logs (uvicorn's own loggers do not propagate to the root)."""
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "specserve")]
    for lg in loggers:
        lg.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    yield caplog
    for lg in loggers:
        lg.removeHandler(caplog.handler)


def test_clients_gone_mid_upload_are_quiet(base, server_logs, llm):
    errors_500 = _metric(base, "specserve_request_errors_total", 'status="500"')
    gone_before = _metric(base, "specserve_request_errors_total", 'status="499"')
    half = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n" + b'{"model": "tiny", "prompt": "hello ' + b"x" * 1000)
    for _ in range(20):
        raw_exchange(base, half, close_after_send=True)
    assert wait_until(lambda: _metric(base, "specserve_request_errors_total", 'status="499"') >= gone_before + 20, 10)
    assert _metric(base, "specserve_request_errors_total", 'status="500"') == errors_500
    noisy = [r for r in server_logs.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]
    assert wait_until(lambda: idle(llm), 10)


def test_a_slow_body_is_408(base):
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(http_request(b"").replace(b"Content-Length: 0", b"Content-Length: 50") + b'{"model": ')
        t0 = time.monotonic()
        out = s.recv(65536)
        elapsed = time.monotonic() - t0
        head = out.split(b"\r\n\r\n", 1)[0].lower()
        length = int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        while len(out.split(b"\r\n\r\n", 1)[1]) < length:
            out += s.recv(65536)
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert LIMITS.body_timeout_s - 0.2 <= elapsed < LIMITS.body_timeout_s + 5
    assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


# ------------------------------------------------------------------ request heads
def read_until_closed(s: socket.socket, trickle: bytes | None = None, give_up: float = 30.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took;
    ``trickle``: bytes sent every 0.2 s meanwhile (a slowloris keeping its head busy)."""
    s.settimeout(0.2)
    out, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < give_up:
        try:
            if trickle:
                s.sendall(trickle)
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:          # reset by the server: closed
            break
        if not chunk:
            break
        out += chunk
    return out, time.monotonic() - t0


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
PARTIAL_HEADS = [
    ("nothing", b""),
    ("half_a_request_line", b"POST /v1/compl"),
    ("half_the_headers", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"),
    ("pipelined_after_a_request", HEALTH + b"GET /heal"),
]


@pytest.mark.parametrize("case", every_nth_fast(PARTIAL_HEADS, 4))
def test_a_partial_head_then_silence_is_408_and_closed(base, witness_alone, case):
    """Connections that never finish their head go away (uvicorn alone keeps them open forever)."""
    _, data = case
    with connect(base) as s:
        s.sendall(data)
        out, elapsed = with_witness(base, witness_alone, lambda: read_until_closed(s))
    assert out.startswith(b"HTTP/1.1 200" if data.startswith(HEALTH) else b"HTTP/1.1 408"), out[:200]
    assert out.count(b"HTTP/1.1 408 Request Timeout") == 1, out[:300]
    assert LIMITS.header_timeout_s - 0.2 <= elapsed < LIMITS.header_timeout_s + 10
    assert local_http.get(f"{base}/health").status_code == 200


def test_a_partial_head_on_a_kept_alive_connection_is_408(base):
    with connect(base) as s:
        s.sendall(HEALTH)
        first = s.recv(65536)
        time.sleep(0.3)
        s.sendall(b"GET /hea")
        out, elapsed = read_until_closed(s)
    out = first + out
    assert out.startswith(b"HTTP/1.1 200") and out.count(b"HTTP/1.1 408 Request Timeout") == 1, out[:300]
    assert LIMITS.header_timeout_s - 0.2 <= elapsed < LIMITS.header_timeout_s + 10


def test_a_head_trickled_forever_is_cut_off_at_the_header_timeout(base, witness_alone):
    """The deadline counts from the connection, not from the last byte: activity does not extend it."""
    with connect(base) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        out, elapsed = with_witness(base, witness_alone, lambda: read_until_closed(s, trickle=b"X-A: b\r\n"))
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert elapsed < LIMITS.header_timeout_s + 10


def test_an_oversized_head_sent_in_pieces_is_431_and_closed(base, witness_alone):
    """h11's own cap on an incomplete head, answered 431 (uvicorn alone says 400)."""
    with connect(base) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        out, _ = with_witness(base, witness_alone, lambda: read_until_closed(s, trickle=b"a" * 4096))
    assert out.startswith(b"HTTP/1.1 431"), out[:200]
    assert str(LIMITS.max_header_bytes).encode() in out


def test_a_head_just_under_the_limit_is_served(base):
    r = local_http.get(f"{base}/health", headers={"X-Big": "a" * (LIMITS.max_header_bytes - 500)})
    assert r.status_code == 200


def test_several_slow_heads_do_not_stop_a_request(base, witness_alone):
    socks = [connect(base) for _ in range(8)]
    try:
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        r = with_witness(base, witness_alone, lambda: local_http.post(f"{base}/v1/completions",
                                                                 json=comp(temperature=0), timeout=60))
        assert r.status_code == 200, r.text
        assert all(read_until_closed(s)[0].startswith(b"HTTP/1.1 408") for s in socks)
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------- no stalling the loop
def test_tokenization_runs_off_the_engine_thread(server, llm, monkeypatch):
    """A prompt that takes 1.5 s to tokenize (slowed on purpose) must not hold up a running
    stream: the engine keeps stepping meanwhile, and a short request is served meanwhile."""
    base, app = server
    async_engine = app.state.async_engine
    engine = llm.engine
    real_tokenize = engine.tokenize
    seen = {}

    def slow_tokenize(prompt):
        if prompt.startswith("SLOW"):
            seen["thread"] = threading.current_thread().name
            steps = async_engine.num_steps
            time.sleep(1.5)
            seen["steps_during"] = async_engine.num_steps - steps
        return real_tokenize(prompt)

    monkeypatch.setattr(engine, "tokenize", slow_tokenize)
    long_stream = dict(WITNESS, max_tokens=200)
    alone = stream_text(base, long_stream)
    started, result = threading.Event(), {}
    thread = threading.Thread(target=lambda: result.setdefault("text", stream_text(base, long_stream, started)))
    thread.start()
    assert started.wait(30)
    slow = local_http.post(f"{base}/v1/completions", json=comp(prompt="SLOW prompt", temperature=0), timeout=60)
    thread.join(60)
    assert slow.status_code == 200
    assert seen["thread"].startswith("specserve-tokenize")
    assert seen["steps_during"] > 0, "the engine did not step while a prompt was being tokenized"
    assert result["text"] == alone


# ----------------------------------------------------------------- disconnect storm
@pytest.mark.parametrize("spec", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "ngram"])
def test_disconnect_storm_leaves_no_block_in_use_and_greedy_output_unchanged(tiny_llama_dir, llm, spec):
    storm_llm = make_llm(tiny_llama_dir, spec) if spec else llm
    app = build_app(storm_llm, MODEL, limits=LIMITS)
    probe = comp(prompt="one two three one two three one", max_tokens=24, temperature=0, ignore_eos=True)
    rng = random.Random(19)

    async def one(http, i):
        body = comp(prompt=f"Stream number {i} counts: 1 2 3 1 2 3", max_tokens=32, ignore_eos=True,
                    stream=True, temperature=0.8 if i % 3 else 0, seed=i)
        leave_after = rng.randint(0, 6) if i % 2 else None        # half of them disconnect at random points
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    assert "error" not in json.loads(line[6:])
                    n += 1
                    if leave_after is not None and n >= leave_after:
                        return "left"
        return "done"

    async def storm(base):
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    try:
        with running_server(app) as base:
            before = local_http.post(f"{base}/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
            results = asyncio.run(storm(base))
            assert results.count("done") >= 32
            assert wait_until(lambda: idle(storm_llm), 30), (
                storm_llm.engine.kv_cache.num_free_blocks, storm_llm.engine.kv_cache.num_blocks)
            after = local_http.post(f"{base}/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
            assert after == before
            assert local_http.get(f"{base}/health").status_code == 200
    finally:
        if spec:
            app.state.async_engine.shutdown()


# ------------------------------------------------------------ one request's failure
def test_a_request_failing_in_the_engine_gets_a_500_and_the_others_carry_on(server, llm, witness_alone, monkeypatch):
    """Injected fault: detokenizing the request whose prompt starts with POISON raises."""
    base, _ = server
    engine = llm.engine
    real_append = engine.output_processor.append

    def append(req, token):
        if (req.prompt or "").startswith("POISON") and req.num_output_tokens >= 1:
            raise RuntimeError("injected fault")
        return real_append(req, token)

    monkeypatch.setattr(engine.output_processor, "append", append)

    def send_both():
        r = local_http.post(f"{base}/v1/completions", json=comp(prompt="POISON a", max_tokens=8), timeout=60)
        with local_http.stream("POST", f"{base}/v1/completions", json=comp(prompt="POISON b", stream=True), timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return r, events

    r, events = with_witness(base, witness_alone, send_both)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "request_failed" and "injected fault" in err["message"]
    stream_err = events[-1]["error"]
    assert set(stream_err) == {"message", "type", "param", "code"} and stream_err["code"] == "request_failed"
    assert wait_until(lambda: idle(llm), 10)
