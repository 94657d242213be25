"""vLLM's /tokenize and /detokenize: the token ids the generation endpoints compute for a
prompt or a conversation, and back; bad input a 400 naming the field. Tiny random model."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.entrypoints.openai.api_server import build_app

from proposer_specs import tiny_engine
from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"


@pytest.fixture(scope="module")
def ref_llm(tiny_llama_dir):
    return tiny_engine(tiny_llama_dir, max_model_len=256)


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    llm = tiny_engine(tiny_llama_dir, max_model_len=256)
    with running_server(build_app(llm, MODEL)) as base:
        yield base


def test_tokenize_and_detokenize_give_the_generation_endpoints_tokens(url, ref_llm):
    tok = ref_llm.get_tokenizer()
    r = local_http.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Hello there, world"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    want = ref_llm.generate("Hello there, world", SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 256
    messages = [{"role": "user", "content": "Hi there"}]
    r = local_http.post(f"{url}/tokenize", json={"messages": messages}, timeout=60)
    assert r.json()["tokens"] == ref_llm.apply_chat_template(messages)
    r = local_http.post(f"{url}/detokenize", json={"model": MODEL, "tokens": want}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(want)
    for path, bad, param in [("/tokenize", {"prompt": "x", "messages": messages}, None),
                             ("/tokenize", {}, None),
                             ("/detokenize", {"tokens": [10 ** 8]}, "tokens"),
                             ("/detokenize", {"tokens": "12"}, "tokens"),
                             ("/tokenize", {"model": "other", "prompt": "x"}, "model")]:
        r = local_http.post(f"{url}{path}", json=bad, timeout=60)
        assert r.status_code in (400, 404), (path, bad, r.text)
        assert param is None or r.json()["error"]["param"] == param, r.text
