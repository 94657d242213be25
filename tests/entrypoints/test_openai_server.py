"""The OpenAI-compatible server, end to end: a real uvicorn server on loopback,
the real ``openai`` client, one float32 engine (greedy outputs compare exactly)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from fastapi.testclient import TestClient

from specserve import LLM, SamplingParams
from specserve.engine.async_engine import AsyncLLMEngine, EngineStepError
from specserve.entrypoints.openai.api_server import build_app, hold_back

from server_util import local_http, running_server, wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2-test"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20, seed=0)


@pytest.fixture(scope="module")
def server(llm):
    """(base_url, app): uvicorn in a background thread on a free loopback port."""
    app = build_app(llm, MODEL)
    with running_server(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def base_url(server):
    return server[0]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _idle(llm) -> bool:
    engine = llm.engine
    return not engine.has_unfinished_requests() and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def _greedy(client, prompt, max_tokens=8, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


# ------------------------------------------------------------------ pure helpers
def test_hold_back_partial_characters_and_stop_prefixes():
    assert hold_back("abc\ufffd", []) == "abc"
    assert hold_back("abc\ufffd\ufffd", []) == "abc"
    assert hold_back("Hello wor", ["world"]) == "Hello "
    assert hold_back("Hello w", ["xyz", "wo"]) == "Hello "
    assert hold_back("Hello", ["\n\n"]) == "Hello"
    assert hold_back("Hello\n", ["\n\n"]) == "Hello"


# ---------------------------------------------------------------- basic routes
def test_health_and_models(base_url, client):
    assert local_http.get(f"{base_url}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    from specserve import __version__
    assert local_http.get(f"{base_url}/version").json() == {"version": __version__}


def test_completion(client, llm):
    out = _greedy(client, "The capital of France is", max_tokens=8)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL
    assert choice.text and choice.finish_reason in ("length", "stop")
    prompt_ids = llm.engine.tokenize("The capital of France is")
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # Token-id prompts give the same greedy text.
    assert _greedy(client, prompt_ids, max_tokens=8).choices[0].text == choice.text


def test_completion_batch_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for c, prompt in zip(out.choices, ["One, two,", "Red, green,"]):
        assert c.text == _greedy(client, prompt, max_tokens=4).choices[0].text
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert "".join(lp.tokens) == c.text
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)


def test_chat(client, llm):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    msg = out.choices[0].message
    assert out.object == "chat.completion"
    assert msg.role == "assistant" and msg.content
    assert out.usage.prompt_tokens == len(llm.apply_chat_template(messages))
    # Same as the LLM facade's chat (the template is applied the same way).
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}]
    assert client.chat.completions.create(model=MODEL, messages=parts, max_tokens=12, temperature=0).choices[0].message.content == msg.content


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the chosen token ranks first


# ------------------------------------------------------------------- streaming
def test_streaming_completion_concatenates_to_non_streamed(client):
    prompt = "Once upon a time, in a small village,"
    full = _greedy(client, prompt, max_tokens=16)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_concatenates_to_non_streamed(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no usage unless stream_options.include_usage


def test_streaming_with_stop_string_holds_back_its_prefix(client):
    prompt = "Count: 1, 2, 3, 4, 5,"
    plain = _greedy(client, prompt, max_tokens=16).choices[0].text
    assert len(plain) > 6
    stop = plain[3:6]
    full = _greedy(client, prompt, max_tokens=16, stop=[stop])
    assert full.choices[0].finish_reason == "stop" and stop not in full.choices[0].text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], stream=True
        )
    )
    assert streamed == full.choices[0].text


# ----------------------------------------------------------------- concurrency
CONCURRENT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "My favourite book is",
    "The quick brown fox",
    "In 1492, Columbus",
    "A haiku about autumn:",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Photosynthesis is the process",
    "SELECT name FROM users WHERE",
    "Dear hiring manager,",
    "The square root of 144 is",
    "Once upon a time",
    "Machine learning is",
]


def test_concurrent_greedy_requests_match_sequential(client, server, llm):
    async_engine: AsyncLLMEngine = server[1].state.async_engine
    sequential = [_greedy(client, p, max_tokens=8).choices[0].text for p in CONCURRENT_PROMPTS]
    steps_before = async_engine.num_steps
    with ThreadPoolExecutor(len(CONCURRENT_PROMPTS)) as pool:
        concurrent = list(pool.map(lambda p: _greedy(client, p, max_tokens=8).choices[0].text, CONCURRENT_PROMPTS))
    assert concurrent == sequential
    # Continuous batching: far fewer engine steps than 16 requests x 8 tokens one by one.
    assert async_engine.num_steps - steps_before < len(CONCURRENT_PROMPTS) * 8 // 2
    assert wait_until(lambda: _idle(llm), timeout=10)


def test_client_disconnect_aborts_and_frees_kv_blocks(base_url, llm):
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    got = 0
    with local_http.Client(timeout=60) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += 1
                    if got == 2:
                        assert llm.engine.has_unfinished_requests()
                        break
    assert got == 2
    assert wait_until(lambda: _idle(llm), timeout=30), (
        f"unfinished={llm.engine.has_unfinished_requests()} free={llm.engine.kv_cache.num_free_blocks}/{llm.engine.kv_cache.num_blocks}"
    )


# ------------------------------------------------------------------ bad inputs
TOO_LONG = "hello " * (MAX_MODEL_LEN + 10)

BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "smollm2-test", "prompt": "x",', None),                 # malformed JSON
    ("/v1/completions", b"[1, 2]", None),                                                    # not an object
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8.5}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [1]}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "bogus_field": 1}, "bogus_field"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": TOO_LONG}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", TOO_LONG]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": TOO_LONG, "stream": True}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_input_is_a_400_in_openai_shape(base_url, path, body, param):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = local_http.post(f"{base_url}{path}", timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_openai_client_sees_bad_request_and_server_carries_on(client, llm):
    with pytest.raises(openai.NotFoundError):  # OpenAI's 404 model_not_found
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=TOO_LONG, max_tokens=4)
    assert _greedy(client, "Still alive?", max_tokens=2).choices[0].text
    assert wait_until(lambda: _idle(llm), timeout=10)


def test_unknown_route_is_404_in_openai_shape(base_url):
    r = local_http.get(f"{base_url}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_engine_error_surfaces_and_server_carries_on(server, llm, client):
    """A step that raises fails the requests in flight (500), frees their blocks, and the next request works."""
    engine = llm.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:  # after the first step, while the request is running
            raise RuntimeError("simulated device failure")
        return real_step()

    engine.step = failing_step
    try:
        with TestClient(server[1]) as tc:
            r = tc.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 500
        assert "simulated device failure" in r.json()["error"]["message"]
    finally:
        del engine.step
    assert wait_until(lambda: _idle(llm), timeout=10)
    assert _greedy(client, "Hello", max_tokens=2).choices[0].text


# ------------------------------------------------------------------------ auth
def test_api_key(llm, server):
    app = build_app(llm, MODEL, api_key="s3cret")  # shares the running engine loop
    assert app.state.async_engine is server[1].state.async_engine
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    with TestClient(app) as tc:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = tc.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, headers
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        assert tc.get("/v1/models").status_code == 401
        for path in ("/completion", "/infill", "/tokenize", "/detokenize"):       # llama-server's and vLLM's routes too
            assert tc.post(path, json={"prompt": "Hi"}).status_code == 401, path
        assert tc.get("/props").status_code == 401
        r = tc.post("/completion", json={"prompt": "Hi", "n_predict": 2}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
        assert tc.get("/health").status_code == 200 and tc.get("/version").status_code == 200
        r = tc.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    c = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=TestClient(app), max_retries=0)
    assert c.models.list().data[0].id == MODEL


# --------------------------------------------------------------------- metrics
def _metric(text: str, name: str) -> float:
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


def test_metrics(base_url, client):
    _greedy(client, "Metrics please", max_tokens=4)
    r = local_http.get(f"{base_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert _metric(text, "specserve_requests_total") >= 1
    assert _metric(text, "specserve_request_success_total") >= 1
    assert _metric(text, "specserve_prompt_tokens_total") > 0
    assert _metric(text, "specserve_generation_tokens_total") >= 4
    assert _metric(text, "specserve_request_errors_total") >= 1  # the bad-input tests ran before
    assert _metric(text, "specserve_time_to_first_token_seconds_count") >= 1
    assert _metric(text, "specserve_time_per_output_token_seconds_count") >= 1
    assert _metric(text, "specserve_e2e_request_latency_seconds_count") >= 1
    assert _metric(text, "specserve_kv_cache_free_blocks") > 0
    # No speculation on this engine: no draft tokens, tau = 1.
    assert _metric(text, "specserve_spec_decode_num_draft_tokens_total") == 0
    assert _metric(text, "specserve_spec_decode_mean_acceptance_length") == 1.0


def test_speculation_pass_through(client):
    """An ngram-speculating engine behind the same API: identical greedy text, speculation metrics."""
    spec_llm = LLM(
        dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=32 << 20, seed=0,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    app = build_app(spec_llm, MODEL)
    prompt = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"
    try:
        with TestClient(app) as tc:
            r = tc.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == _greedy(client, prompt, max_tokens=16).choices[0].text
            text = tc.get("/metrics").text
        assert _metric(text, "specserve_num_speculative_tokens") == 3
        drafts = _metric(text, "specserve_spec_decode_num_drafts_total")
        draft_tokens = _metric(text, "specserve_spec_decode_num_draft_tokens_total")
        accepted = _metric(text, "specserve_spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and draft_tokens > 0 and 0 < accepted <= draft_tokens
        assert _metric(text, "specserve_spec_decode_acceptance_rate") == pytest.approx(accepted / draft_tokens, rel=1e-6)
        stats = spec_llm.get_spec_decode_stats()
        assert _metric(text, "specserve_spec_decode_mean_acceptance_length") == pytest.approx(stats.mean_acceptance_length)
        assert stats.mean_acceptance_length > 1.0
    finally:
        app.state.async_engine.shutdown()


# ------------------------------------------------------------- the async engine
def test_async_engine_generate_and_abort(llm, server):
    """Direct use: cumulative outputs, the same text as the server, and abort by leaving the loop."""
    async_engine = AsyncLLMEngine.from_engine(llm)
    assert async_engine is server[1].state.async_engine

    async def run():
        outs = [o async for o in async_engine.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)
        n = 0
        async for _ in async_engine.generate("Tell me a story", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)):
            n += 1
            if n == 2:
                break  # leaving early aborts
        with pytest.raises(ValueError):
            async for _ in async_engine.generate(TOO_LONG, SamplingParams(max_tokens=4)):
                pass
        return outs[-1].outputs[0].text

    text = asyncio.run(run())
    assert text
    assert wait_until(lambda: _idle(llm), timeout=10)


def test_async_engine_step_error_reaches_every_waiting_request(llm):
    engine = llm.engine
    async_engine = AsyncLLMEngine.from_engine(llm)

    def broken_step():
        raise RuntimeError("boom")

    async def run():
        async def one(p):
            async for _ in async_engine.generate(p, SamplingParams(temperature=0, max_tokens=4)):
                pass

        return await asyncio.gather(*(one(p) for p in ("a", "b", "c")), return_exceptions=True)

    engine.step = broken_step
    try:
        results = asyncio.run(asyncio.wait_for(run(), timeout=30))
    finally:
        del engine.step
    assert all(isinstance(r, EngineStepError) and "boom" in str(r) for r in results), results
    assert wait_until(lambda: _idle(llm), timeout=10)
