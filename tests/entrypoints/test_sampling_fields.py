"""The OpenAI sampling fields over HTTP: ``n`` (choices numbered as OpenAI
numbers them, streamed and not), ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty`` and ``logit_bias`` reach the engine and change the tokens as the
library does; out-of-range values are 400s naming the field. Tiny random model."""
from __future__ import annotations

import itertools
import json

import httpx
import pytest

from specserve import LLM, SamplingParams
from specserve.entrypoints.openai.api_server import build_app

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
PROMPT = [300 + i for i in range(40)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def ref_llm(tiny_llama_dir):
    """The library side of each comparison: its own engine. (Stepping the server's engine from
    the test's thread would race with the server's engine thread.)"""
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3}, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def base_url(llm):
    with running_server(build_app(llm, MODEL)) as url:
        yield url


def post(base_url, path, body) -> httpx.Response:
    return local_http.post(f"{base_url}{path}", json=body, timeout=120)


def lone(llm, prompt, **kw) -> list[int]:
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0].token_ids


def test_n_choices_are_numbered_per_prompt(base_url, ref_llm):
    llm = ref_llm
    body = {"model": MODEL, "prompt": [PROMPT, PROMPT[:25]], "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    tok = llm.get_tokenizer()
    for c in choices:
        prompt = PROMPT if c["index"] < 3 else PROMPT[:25]
        want = lone(llm, prompt, temperature=1.0, seed=11 + c["index"] % 3, max_tokens=6)
        assert c["text"] == tok.decode(want), c["index"]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 40 + 25 and usage["completion_tokens"] == 36


def test_n_choices_stream(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 5,
            "temperature": 1.0, "seed": 5, "stream": True}
    texts, finishes = {0: "", 1: ""}, {}
    with local_http.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["delta"].get("content") or ""
                if c["finish_reason"] is not None:
                    assert c["index"] not in finishes       # each choice finishes once
                    finishes[c["index"]] = c["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    whole = post(base_url, "/v1/chat/completions", dict(body, stream=False)).json()
    assert [c["message"]["content"] for c in whole["choices"]] == [texts[0], texts[1]]


def test_penalties_and_logit_bias_reach_the_engine(base_url, ref_llm):
    llm = ref_llm
    fields = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, **fields,
            "logit_bias": {"400": 30, "401": 29.5}}
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    want = lone(llm, PROMPT, temperature=0.0, max_tokens=12, logit_bias={400: 30.0, 401: 29.5}, **fields)
    assert r.json()["choices"][0]["text"] == llm.get_tokenizer().decode(want)
    assert want[:2] == [400, 401]                   # the bias wins, then the penalty moves off 400
    assert want != lone(llm, PROMPT, temperature=0.0, max_tokens=12)


def test_min_tokens_reaches_the_engine(base_url, ref_llm):
    eos = ref_llm.get_tokenizer().eos_token_id
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "logit_bias": {str(eos): 30},
            "min_tokens": 5}
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["choices"][0]["finish_reason"] == "stop"
    r = post(base_url, "/v1/completions", dict(body, min_tokens=13))
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_allowed_token_ids_bad_words_and_include_stop_str_in_output_reach_the_engine(base_url, ref_llm):
    allowed = [400, 401, 402]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "allowed_token_ids": allowed}
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    want = lone(ref_llm, PROMPT, temperature=0.0, max_tokens=8, allowed_token_ids=allowed)
    assert set(want) <= set(allowed) and r.json()["choices"][0]["text"] == ref_llm.get_tokenizer().decode(want)
    stop = ref_llm.get_tokenizer().decode(want[2:4])
    for include in (False, True):
        r = post(base_url, "/v1/completions", dict(body, stop=[stop], include_stop_str_in_output=include))
        text = r.json()["choices"][0]["text"]
        assert text.endswith(stop) == include and r.json()["choices"][0]["stop_reason"] == stop, text
    r = post(base_url, "/v1/completions", dict(body, allowed_token_ids=[1, 10 ** 8]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    word = ref_llm.get_tokenizer().decode(want[:1]).strip()
    r = post(base_url, "/v1/completions", dict(body, bad_words=[word]))
    assert r.json()["choices"][0]["text"] == ref_llm.get_tokenizer().decode(
        lone(ref_llm, PROMPT, temperature=0.0, max_tokens=8, allowed_token_ids=allowed, bad_words=[word]))
    assert want[0] not in lone(ref_llm, PROMPT, temperature=0.0, max_tokens=8, allowed_token_ids=allowed,
                               bad_words=[word])


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(base_url):
    """Each chunk's completion_tokens is the tokens streamed so far, counted from the chunks'
    logprobs (a chunk may carry several tokens where the engine ran ahead of the client)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with local_http.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == len(PROMPT) for c in chunks)
    so_far = itertools.accumulate(sum(len(choice["logprobs"]["tokens"]) for choice in c["choices"])
                                  for c in chunks)
    assert counts == list(so_far) and counts[-1] == 6, chunks
    with local_http.stream("POST", f"{base_url}/v1/completions", timeout=60,
                           json=dict(body, stream_options={"include_usage": True})) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]


def test_truncate_prompt_tokens_reaches_the_engine(base_url, ref_llm):
    long = [(71 * i + 13) % 3000 + 200 for i in range(300)]    # longer than the context (256)
    body = {"model": MODEL, "prompt": long, "max_tokens": 4, "temperature": 0.0}
    r = post(base_url, "/v1/completions", dict(body, truncate_prompt_tokens=20))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20
    assert r.json()["choices"][0]["text"] == ref_llm.get_tokenizer().decode(
        lone(ref_llm, long[-20:], temperature=0.0, max_tokens=4))
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("field,value", [
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
    ("min_tokens", -1), ("min_tokens", "2"), ("allowed_token_ids", []), ("allowed_token_ids", [-3]),
    ("bad_words", [""]), ("bad_words", "word"),
    ("include_stop_str_in_output", 1),
    ("n", 0), ("n", 129), ("n", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", "1.1"), ("logit_bias", {"abc": 1}),
    ("logit_bias", {"-1": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"999999999": 1}),
    ("logit_bias", [1, 2]),
])
def test_bad_values_are_400s_naming_the_field(base_url, field, value):
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in (err.get("param") or "") + err["message"], err
