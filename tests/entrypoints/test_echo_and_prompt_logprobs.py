"""/v1/completions' ``echo`` (the prompt before the answer, and with ``logprobs`` the prompt
tokens' log-probabilities first, as log-likelihood evaluations ask: ``max_tokens`` 0, echo,
logprobs) and vLLM's ``prompt_logprobs`` field, over HTTP with the real ``openai`` client,
against the library's ``SamplingParams.prompt_logprobs``. Tiny random model, n-gram
speculation on."""
from __future__ import annotations

import json

import openai
import pytest

from specserve import LLM, SamplingParams
from specserve.entrypoints.openai.api_server import build_app

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
PROMPT_IDS = [(29 * i + 7) % 4000 + 300 for i in range(30)]
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               speculative_config=SPEC)


@pytest.fixture(scope="module")
def ref_llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               speculative_config=SPEC)


@pytest.fixture(scope="module")
def client(llm):
    with running_server(build_app(llm, MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url


def reference(ref_llm, prompt, **kw):
    return ref_llm.generate(prompt, SamplingParams(temperature=0, prompt_logprobs=2, logprobs=2, **kw),
                            use_tqdm=False)[0]


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs(client, ref_llm):
    c, _ = client
    tok = ref_llm.get_tokenizer()
    out = c.completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, logprobs=2, max_tokens=0, temperature=0)
    [choice] = out.choices
    ref = reference(ref_llm, PROMPT_IDS, max_tokens=1)
    assert choice.text == tok.decode(PROMPT_IDS)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in PROMPT_IDS]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(PROMPT_IDS) if i]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-6)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(PROMPT_IDS))]


def test_echo_puts_the_prompt_before_the_answer_and_its_logprobs_before_the_answers(client, ref_llm):
    c, _ = client
    prompt = "The quick brown fox jumps over"
    out = c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=5, temperature=0)
    ref = reference(ref_llm, prompt, max_tokens=5)
    [choice] = out.choices
    assert choice.text == prompt + ref.outputs[0].text
    lp = choice.logprobs
    n_prompt = len(ref.prompt_token_ids)
    assert len(lp.token_logprobs) == n_prompt + 5 and lp.token_logprobs[0] is None
    answer = [ref.outputs[0].logprobs[i][t].logprob for i, t in enumerate(ref.outputs[0].token_ids)]
    assert lp.token_logprobs[n_prompt:] == pytest.approx(answer, abs=1e-6)
    assert lp.text_offset[n_prompt] == len(prompt)
    plain = c.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=5, temperature=0)
    assert plain.choices[0].text == prompt + ref.outputs[0].text and plain.choices[0].logprobs is None


def test_a_streamed_echo_sends_the_prompt_first(client, ref_llm):
    c, _ = client
    prompt = "Once upon a time"
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=6,
                                       temperature=0, stream=True))
    ref = reference(ref_llm, prompt, max_tokens=6)
    assert chunks[0].choices[0].text.startswith(prompt)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(ch.choices[0].text for ch in chunks) == prompt + ref.outputs[0].text
    token_lps = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert len(token_lps) == len(ref.prompt_token_ids) + 6


def test_vllms_prompt_logprobs_field_in_completions_and_chat(client, ref_llm):
    _, url = client
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 1}
    r = local_http.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ref = reference(ref_llm, PROMPT_IDS, max_tokens=2)
    for choice in r.json()["choices"]:
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(PROMPT_IDS)
        got = [entries[i][str(t)]["logprob"] for i, t in enumerate(PROMPT_IDS) if i]
        assert got == pytest.approx([ref.prompt_logprobs[i][t].logprob for i, t in enumerate(PROMPT_IDS) if i],
                                    abs=1e-6)
        assert all(sum(e["rank"] == 1 for e in entry.values()) == 1 for entry in entries[1:])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2,
            "prompt_logprobs": 0}
    r = local_http.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    entries = r.json()["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    assert "prompt_logprobs" not in json.dumps(r.json()["choices"])


def test_max_tokens_0_needs_echo(client):
    _, url = client
    r = local_http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"

