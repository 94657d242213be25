"""The API's ``priority`` field (vLLM's extension): taken under --scheduling-policy priority, a 400
naming the field otherwise (and with beam search, which has none). Tiny random model."""
from __future__ import annotations

import pytest

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BODY = {"prompt": [300, 301, 302], "max_tokens": 2, "temperature": 0}


def post(url, **fields):
    return local_http.post(f"{url}/v1/completions", json={**BODY, **fields}, timeout=60)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_priority_field(tiny_llama_dir, policy):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
              scheduling_policy=policy)
    with running_server(build_app(llm, "tiny")) as url:
        assert post(url, priority=0).status_code == 200
        r = post(url, priority=-3)
        if policy == "priority":
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
            assert "--scheduling-policy priority" in r.json()["error"]["message"]
        assert post(url, priority=1 << 40).status_code == 400
        beams = post(url, priority=1, use_beam_search=True, n=2)
        assert beams.status_code == 400 and "priority" in beams.json()["error"]["message"]
        chat = local_http.post(f"{url}/v1/chat/completions", timeout=60,
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 2})
        assert chat.status_code == (200 if policy == "priority" else 400)
