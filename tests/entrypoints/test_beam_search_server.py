"""vLLM's ``use_beam_search`` over HTTP: completions search ``best_of`` beams (default
``n``) and answer the ``n`` best, chat searches ``n``; the texts and order are the library's
``LLM.beam_search``'s, streamed or not, with n-gram speculation on the server; fields that
cannot go with beam search are 400s naming them, and an answer carries no logprobs it was not
asked for. Tiny random model."""
from __future__ import annotations

import json

import httpx
import pytest

from specserve import LLM
from specserve.beam_search_params import BeamSearchParams
from specserve.entrypoints.openai.api_server import build_app

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
PROMPT = [300 + i for i in range(20)]


def make(model_dir, **kw) -> LLM:
    return LLM(model=model_dir, max_model_len=256, kv_cache_memory=8 << 20, max_num_seqs=8, **kw)


@pytest.fixture(scope="module")
def base_url(tiny_llama_dir):
    llm = make(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with running_server(build_app(llm, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def ref_llm(tiny_llama_dir):
    return make(tiny_llama_dir)


def post(base_url, path, body) -> httpx.Response:
    return local_http.post(f"{base_url}{path}", json=body, timeout=120)


def test_completions_return_the_n_best_of_best_of_beams(base_url, ref_llm):
    expected = ref_llm.beam_search([PROMPT], BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=0.5))[0]
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "use_beam_search": True, "best_of": 4,
                                           "n": 2, "max_tokens": 8, "length_penalty": 0.5, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"] for c in choices] == [s.text for s in expected.sequences[:2]]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in expected.sequences[:2]]
    assert all(c["logprobs"] is None for c in choices)     # not asked for, though each beam has them
    assert r.json()["usage"]["completion_tokens"] == sum(len(s.tokens) - len(PROMPT) for s in expected.sequences[:2])


def test_streamed_and_chat(base_url, ref_llm):
    expected = ref_llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6))[0]
    texts = {}
    with local_http.stream("POST", f"{base_url}/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 6,
                                 "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                    assert c["logprobs"] is None
    assert [texts[i] for i in range(3)] == [s.text for s in expected.sequences]
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = ref_llm.apply_chat_template(messages)
    chat_expected = ref_llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=5))[0]
    r = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "use_beam_search": True, "n": 2,
                                                "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert [c["message"]["content"] for c in r.json()["choices"]] == [s.text for s in chat_expected.sequences]
    assert all(c["logprobs"] is None for c in r.json()["choices"])


@pytest.mark.parametrize("body,field", [
    ({"best_of": 3}, "best_of"),                                      # best_of > 1 needs use_beam_search
    ({"use_beam_search": True, "best_of": 2, "n": 3}, "n"),
    ({"length_penalty": 2.0}, "length_penalty"),                      # beam search's field without it
    ({"use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"use_beam_search": True, "n": 9}, "max_num_seqs"),              # more beams than one step runs
])
def test_bad_beam_search_requests_are_400s(base_url, body, field):
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert field in r.text


def test_chat_refuses_tools_with_beam_search(base_url):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "use_beam_search": True, "n": 2, "tools": [tool]})
    assert r.status_code == 400 and "tools" in r.text
