"""POST /v1/embeddings with OpenAI's own client: float and base64 (the client's default) give the
LLM API's vectors; a list of texts and of token-id lists; usage; a LoRA adapter named in model;
bad input is a 400."""
from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20, pooling="mean")
    return llm, build_app(llm, "tiny")


def test_the_openai_client_gets_the_llm_apis_vectors(served):
    llm, app = served
    outs = llm.embed(["Hello there", "A cat"])
    want, prompt_tokens = [o.outputs.embedding for o in outs], sum(len(o.prompt_token_ids) for o in outs)
    ids = llm.get_tokenizer().encode("A cat")
    with TestClient(app) as tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        got = client.embeddings.create(model="tiny", input=["Hello there", "A cat"])   # base64 underneath
        for d, w in zip(got.data, want):
            assert d.embedding == pytest.approx(w, abs=1e-6)
        assert [d.index for d in got.data] == [0, 1]
        assert got.usage.prompt_tokens == prompt_tokens
        floats = tc.post("/v1/embeddings", json={"input": "Hello there", "encoding_format": "float"}).json()
        assert floats["data"][0]["embedding"] == pytest.approx(want[0], abs=1e-6) and floats["model"] == "tiny"
        by_ids = tc.post("/v1/embeddings", json={"input": [ids], "encoding_format": "float"}).json()
        assert by_ids["data"][0]["embedding"] == pytest.approx(want[1], abs=1e-6)
        metrics = tc.get("/metrics").text
        assert 'specserve_requests_total{endpoint="embeddings",model_name="tiny"}' in metrics
        assert f'vllm:prompt_tokens_total{{model_name="tiny"}} {float(2 * prompt_tokens):.1f}' in metrics   # the two inputs twice


@pytest.mark.parametrize("body,status,param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, None),
    ({"input": "hi", "dimensions": 8}, 400, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, 400, None),
    ({"input": [[999999]]}, 400, "input"),
    ({"input": "hi", "model": "nobody"}, 404, "model"),
])
def test_bad_requests(served, body, status, param):
    _, app = served
    with TestClient(app) as tc:
        r = tc.post("/v1/embeddings", json=body)
        assert r.status_code == status, r.text
        if param:
            assert r.json()["error"]["param"] == param
        assert tc.get("/health").status_code == 200


def test_llama_servers_embedding_endpoint(served):
    """POST /embedding (and /embeddings): llama-server's ``content`` -> ``[{"index", "embedding": [v]}]``,
    normalized by its ``embd_normalize`` (2 euclidean by default, -1 none, 1 taxicab, 0 int16 scale)."""
    import numpy as np

    _, app = served
    with TestClient(app) as tc:
        vector = tc.post("/v1/embeddings", json={"input": "Hello there", "encoding_format": "float"}).json()
        raw = np.asarray(tc.post("/embedding", json={"content": "Hello there", "embd_normalize": -1}).json()[0]
                         ["embedding"][0])
        np.testing.assert_allclose(vector["data"][0]["embedding"], raw / np.linalg.norm(raw), atol=1e-6)
        out = tc.post("/embedding", json={"content": "Hello there"}).json()
        assert [o["index"] for o in out] == [0] and len(out[0]["embedding"]) == 1
        np.testing.assert_allclose(out[0]["embedding"][0], raw / np.linalg.norm(raw), atol=1e-6)
        for norm, want in ((-1, raw), (1, raw / np.abs(raw).sum()), (0, raw * 32760 / np.abs(raw).max()),
                           (3, raw / (np.abs(raw) ** 3).sum() ** (1 / 3))):
            got = tc.post("/embeddings", json={"input": "Hello there", "embd_normalize": norm}).json()
            np.testing.assert_allclose(got[0]["embedding"][0], want, rtol=1e-5, atol=1e-4)
        two = tc.post("/embedding", json={"content": ["Hello there", "A cat"]}).json()
        assert [o["index"] for o in two] == [0, 1]
        assert tc.post("/embedding", json={"content": "x", "input": "y"}).status_code == 400
        assert tc.post("/embedding", json={"content": "x", "embd_normalize": -2}).status_code == 400
