"""A thinking model's reasoning apart from its answer (``openai/reasoning.py``; vLLM's
--reasoning-parser): the split of whole answers, streams cut anywhere giving the same split, and
the server's chat and Responses answers (tiny random model: it writes no closing tag, so under
deepseek_r1 all of it is reasoning, under qwen3 all of it content)."""
from __future__ import annotations

import json
import random
import re

import openai
import pytest

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.reasoning import PARSERS

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ANSWERS = ["<think>17 * 23: 340 + 51 = 391.</think>\n\n391", "17 * 23 = 391.</think>391", "<think>still thinking",
           "just an answer", "", "<think></think>empty reasoning", "a < b and </thin is not a tag</think>ok",
           "<thi", "</think>", "<think>x</think>y</think>z"]


@pytest.mark.parametrize("answer, deepseek, qwen3", [
    (ANSWERS[0], ("17 * 23: 340 + 51 = 391.", "\n\n391"), ("17 * 23: 340 + 51 = 391.", "\n\n391")),
    (ANSWERS[1], ("17 * 23 = 391.", "391"), (None, ANSWERS[1])),
    (ANSWERS[2], ("still thinking", None), ("still thinking", None)),
    (ANSWERS[3], ("just an answer", None), (None, "just an answer")),
    (ANSWERS[5], (None, "empty reasoning"), (None, "empty reasoning")),
    (ANSWERS[9], ("x", "y</think>z"), ("x", "y</think>z")),
])
def test_whole_answers_split(answer, deepseek, qwen3):
    assert PARSERS["deepseek_r1"].split(answer) == deepseek
    assert PARSERS["qwen3"].split(answer) == qwen3


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_stream_cut_anywhere_joins_to_the_split(name):
    rng = random.Random(0)
    parser = PARSERS[name]
    for answer in ANSWERS:
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(0, 6)))) if len(answer) > 1 else []
            pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])] or [""]
            stream, reasoning, content = parser.stream(), "", ""
            for i, piece in enumerate(pieces):
                r, c = stream.feed(piece, final=i == len(pieces) - 1)
                reasoning, content = reasoning + r, content + c
            assert (reasoning or None, content or None) == parser.split(answer), (answer, pieces)


@pytest.mark.parametrize("pieces, deepseek, qwen3", [
    (["<think>", "ab", "</th", "ink>", "x"], 4, 4),   # through the token that completes the tag
    (["ab", "</think>", "x"], 2, 0),
    (["<think>", "a"], 2, 2),                          # cut while thinking: all of it
    (["a", "b"], 2, 0),
    ([], 0, 0),
])
def test_reasoning_token_counts(pieces, deepseek, qwen3):
    ids = list(range(len(pieces)))

    def decode(token_ids):
        return "".join(pieces[i] for i in token_ids)

    assert PARSERS["deepseek_r1"].reasoning_tokens(ids, decode) == deepseek
    assert PARSERS["qwen3"].reasoning_tokens(ids, decode) == qwen3


def streamed_split(url: str, body: dict) -> tuple[str, str]:
    """(the reasoning, the content) of the chat request ``body`` streamed, its pieces joined."""
    reasoning = content = ""
    with local_http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    return reasoning, content


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_server_returns_reasoning_apart(llm, parser):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    with running_server(build_app(llm, "tiny")) as plain_url:
        text = local_http.post(f"{plain_url}/v1/chat/completions", json=body, timeout=60).json()[
            "choices"][0]["message"]["content"]
    with running_server(build_app(llm, "tiny", reasoning_parser=parser)) as url:
        message = local_http.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        want = PARSERS[parser].split(text)
        assert (message["reasoning_content"], message["content"]) == want
        assert message["reasoning"] == message["reasoning_content"]
        counts = local_http.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        assert counts["completion_tokens_details"]["reasoning_tokens"] == (counts["completion_tokens"] if want[0] else 0)
        reasoning, content = streamed_split(url, body)
        assert (reasoning or None, content or None) == want
        # structured output leaves the reasoning free: this model writes no tag, so under
        # deepseek_r1 its answer is the unconstrained one, all reasoning (the test below has a tag)
        constrained = local_http.post(f"{url}/v1/chat/completions", timeout=60, json={
            **body, "response_format": {"type": "json_object"}}).json()["choices"][0]["message"]
        if parser == "deepseek_r1":
            assert (constrained["reasoning_content"], constrained["content"]) == want
        # the Responses API: a reasoning item before the message
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        response = client.responses.create(model="tiny", input="hi", max_output_tokens=6, temperature=0)
        kinds = [o.type for o in response.output]
        assert kinds == [k for k, part in (("reasoning", want[0]), ("message", want[1])) if part]
        if want[0]:
            assert response.output[0].content[0].text == want[0]
            events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=6, temperature=0,
                                                  stream=True))
            assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want[0]


def test_structured_output_governs_the_answer_after_the_reasoning(llm):
    """A bias of 100 on the pieces of "</think>" makes the model write the tag by chance; the
    regex then holds for the answer: ">"s as content, the reasoning before the tag apart, in
    whole answers and streams alike, with the reasoning tokens counted."""
    pieces = llm.engine.tokenizer.encode("</think>", add_special_tokens=False)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 80, "temperature": 1.0,
            "seed": 3, "logit_bias": {str(t): 100 for t in pieces}, "structured_outputs": {"regex": ">+"}}
    with running_server(build_app(llm, "tiny", reasoning_parser="deepseek_r1")) as url:
        answer = local_http.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        message = answer["choices"][0]["message"]
        assert message["reasoning_content"] is not None and "</think>" not in message["reasoning_content"]
        assert re.fullmatch(">+", message["content"]), message
        assert 0 < answer["usage"]["completion_tokens_details"]["reasoning_tokens"] < answer["usage"]["completion_tokens"]
        assert streamed_split(url, body) == (message["reasoning_content"], message["content"])


def test_an_unknown_parser_is_refused(llm):
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        build_app(llm, "tiny", reasoning_parser="o1")
