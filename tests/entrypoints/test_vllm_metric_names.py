"""The server's metrics under vLLM's names (``openai/vllm_metric_names.py``): every vLLM-named
family carries its specserve counterpart's samples, the scheduler's queues and preemptions are
read live, and a name missing from specserve's metrics is caught."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from specserve import LLM, SamplingParams
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.metrics import ServerMetrics
from specserve.entrypoints.openai.vllm_metric_names import VLLM_NAMES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SUFFIXES = ("", "_total", "_bucket", "_count", "_sum")     # a family's samples (not its _created)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def vllm_view_matches(text: str) -> None:
    """Every vLLM sample equals the specserve sample it renames, and each table entry is present."""
    got = samples(text)
    families = {f.name for f in text_string_to_metric_families(text)}
    for ours, theirs in VLLM_NAMES.items():
        assert ours in families, f"{ours} (VLLM_NAMES) is not one of the server's metrics"
        own = {k: v for k, v in got.items() if k[0] in [ours + x for x in SUFFIXES]}
        for vllm_name, labels in theirs:
            renamed = {(vllm_name + name[len(ours):], frozenset((labels.get(a, a), b) for a, b in lab)): v
                       for (name, lab), v in own.items() if name in [ours + x for x in SUFFIXES]}
            assert all(got.get(k) == v for k, v in renamed.items()), vllm_name
            assert len(renamed) == sum(1 for name, _ in got if name in [vllm_name + x for x in SUFFIXES]), vllm_name


def test_vllm_names_carry_the_same_samples(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, enable_lora=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    with TestClient(build_app(llm, "tiny")) as tc:
        body = {"model": "tiny", "prompt": "1, 2, 3, 1, 2, 3, 1, 2,", "max_tokens": 12, "temperature": 0}
        assert tc.post("/v1/completions", json=body).status_code == 200
        text = tc.get("/metrics").text
    vllm_view_matches(text)
    got = samples(text)
    assert got[("vllm:request_success_total", frozenset({("finished_reason", "length"), ("model_name", "tiny")}))] == 1
    assert got[("vllm:generation_tokens_total", frozenset({("model_name", "tiny")}))] == 12
    drafted = got[("vllm:spec_decode_num_draft_tokens_total", frozenset({("model_name", "tiny")}))]
    assert drafted > 0


def test_queues_and_preemptions_are_read_at_scrape_time(tiny_llama_dir):
    """Requests added but not yet stepped wait; a cache of one request's blocks preempts."""
    # 5 blocks of 16 tokens (8 KiB each for this model): three requests of 50 tokens do not fit at once
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=40 << 10, max_num_seqs=4,
              enable_lora=True)   # (its gauge is one of the renamed metrics)
    assert llm.engine.kv_cache.num_blocks == 5
    metrics = ServerMetrics(SimpleNamespace(engine=llm.engine), "tiny")

    def value(name: str) -> float:
        return samples(metrics.render().decode())[(name, frozenset({("model_name", "tiny")}))]

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        llm.engine.add_request(list(range(10 + i, 20 + i)), params, request_id=str(i))
    assert value("vllm:num_requests_waiting") == 3 and value("vllm:num_requests_running") == 0
    llm.engine.step()
    assert value("vllm:num_requests_running") + value("vllm:num_requests_waiting") == 3
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert value("vllm:num_preemptions_total") == llm.engine.scheduler.num_preemptions > 0
    vllm_view_matches(metrics.render().decode())
