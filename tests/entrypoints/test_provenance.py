"""Per-token provenance over HTTP (``"specserve": {"provenance": true}``): present only
when asked, one entry per completion token, text pieces that concatenate to the
answer, sources that add up to the stats; ``/v1/specserve/info``. Tiny random models."""
from __future__ import annotations

import json

import httpx
import pytest

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.provenance import token_pieces
from specserve.outputs import TOKEN_SOURCES

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
K = 3
PROMPT = [300 + (i % 7) for i in range(30)]
ASK = {"specserve": {"provenance": True}}


@pytest.fixture(scope="module")
def base_url(tiny_llama_dir, tiny_draft_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
              speculative_config={"method": "draft_model", "model": tiny_draft_dir, "num_speculative_tokens": K})
    with running_server(build_app(llm, MODEL)) as url:
        yield url


def post(base_url, path, body) -> httpx.Response:
    return local_http.post(f"{base_url}{path}", json=body, timeout=120)


def stream_chunks(base_url, path, body) -> list[dict]:
    chunks = []
    with local_http.stream("POST", f"{base_url}{path}", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def check_adds_up(tokens: list[dict], stats: dict, num_tokens: int) -> None:
    sources = [t["source"] for t in tokens]
    assert len(tokens) == num_tokens and set(sources) <= set(TOKEN_SOURCES)
    assert sources[0] == "plain"
    closed = sources.count("recovered") + sources.count("bonus")
    assert stats["num_drafts"] - closed in (0, 1)
    assert 0 <= stats["num_accepted_tokens"] - sources.count("accepted") <= K
    assert "accepted" in sources and len(set(sources)) >= 3   # plain, accepted and a closing kind


def test_completion_carries_provenance_only_when_asked(base_url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    plain = post(base_url, "/v1/completions", body).json()
    assert all("specserve" not in c for c in plain["choices"])
    r = post(base_url, "/v1/completions", dict(body, **ASK))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ext = choice["specserve"]
    check_adds_up(ext["tokens"], ext["stats"], r.json()["usage"]["completion_tokens"])
    assert "".join(t["text"] for t in ext["tokens"]) == choice["text"] == plain["choices"][0]["text"]


def test_streamed_chat_carries_each_chunks_tokens_and_the_stats_at_the_end(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count: 1 2 3 1 2 3 1 2 3"}],
            "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    plain = stream_chunks(base_url, "/v1/chat/completions", body)
    assert all("specserve" not in c for chunk in plain for c in chunk["choices"])
    chunks = stream_chunks(base_url, "/v1/chat/completions", dict(body, **ASK))
    tokens, content, stats = [], "", None
    for chunk in chunks:
        for c in chunk["choices"]:
            content += c["delta"].get("content", "")
            if "specserve" in c:
                tokens += c["specserve"]["tokens"]
                if c["finish_reason"] is not None:
                    stats = c["specserve"]["stats"]
            else:
                assert c["delta"] in ({"role": "assistant", "content": ""},), c
    assert stats is not None
    check_adds_up(tokens, stats, chunks[-1]["usage"]["completion_tokens"])
    assert "".join(t["text"] for t in tokens) == content


def test_streamed_completion_with_n_samples(base_url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 1.0,
            "seed": 2, "n": 2, **ASK}
    per_choice: dict[int, list] = {0: [], 1: []}
    stats = {}
    for chunk in stream_chunks(base_url, "/v1/completions", body):
        for c in chunk["choices"]:
            per_choice[c["index"]] += c["specserve"]["tokens"]
            if c["finish_reason"] is not None:
                stats[c["index"]] = c["specserve"]["stats"]
    for i in (0, 1):
        assert len(per_choice[i]) == 12 and per_choice[i][0]["source"] == "plain"
        assert stats[i]["num_accepted_tokens"] >= sum(t["source"] == "accepted" for t in per_choice[i])


def test_unknown_extension_keys_are_a_400(base_url):
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                           "specserve": {"provenance": True, "colour": "red"}})
    assert r.status_code == 400 and "colour" in r.text
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                           "specserve": {"provenance": "yes"}})
    assert r.status_code == 400


def test_info_names_the_model_and_the_proposer(base_url):
    info = local_http.get(f"{base_url}/v1/specserve/info").json()
    assert info["model"] == MODEL and info["max_model_len"] == 256
    assert info["speculative"]["method"] == "draft_model" and info["speculative"]["num_speculative_tokens"] == K


class _ByteTokenizer:
    """One token per UTF-8 byte: multi-byte characters span several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_pieces_of_split_characters_concatenate_to_the_text():
    text = "héllo € 🙂 done"
    ids = list(text.encode("utf-8"))
    pieces = token_pieces(_ByteTokenizer(), ids, 0, len(ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(token_pieces(_ByteTokenizer(), ids, 0, 4) + token_pieces(_ByteTokenizer(), ids, 4, len(ids))) == text
