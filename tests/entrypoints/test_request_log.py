"""vLLM's --enable-log-requests: one line a queued request on the ``specserve.requests`` logger
(its id, endpoint, prompt length, priority and settings, never the prompt's text), silent unless
turned on."""
from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from specserve import LLM
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.request_streams import REQUEST_LOG

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_requests_are_logged_without_their_text_when_asked(tiny_llama_dir, caplog):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    secret = "my private question"
    with TestClient(build_app(llm, "tiny")) as tc:
        with caplog.at_level(logging.WARNING, logger=REQUEST_LOG.name):
            tc.post("/v1/completions", json={"model": "tiny", "prompt": secret, "max_tokens": 2})
        assert not [r for r in caplog.records if r.name == REQUEST_LOG.name]     # off: nothing
        with caplog.at_level(logging.INFO, logger=REQUEST_LOG.name):
            tc.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "temperature": 0.5, "seed": 3,
                                                  "messages": [{"role": "user", "content": secret}]})
            tc.post("/completion", json={"prompt": secret, "n_predict": 2})
    lines = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOG.name]
    assert len(lines) == 2 and "(chat)" in lines[0] and "(completion)" in lines[1]
    assert "prompt of" in lines[0] and "temperature=0.5" in lines[0] and "seed=3" in lines[0]
    assert all(secret not in line for line in lines)


def test_the_flag_parses(tmp_path):
    from specserve.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--enable-log-requests"]).enable_log_requests


def test_a_request_with_llama_servers_lora_mix_is_logged(peaked_llama_dir, tmp_path, caplog):
    """A request that runs with llama-server's --lora files at a scale (a LoRAMix) logs its mix."""
    from lora_adapters import write_peft_adapter

    adapter = write_peft_adapter(peaked_llama_dir, str(tmp_path / "a"), seed=1)
    llm = LLM(model=peaked_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20, enable_lora=True)
    with TestClient(build_app(llm, "tiny", llama_loras=[(adapter, 0.5)])) as tc:
        with caplog.at_level(logging.INFO, logger=REQUEST_LOG.name):
            assert tc.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    [line] = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOG.name]
    assert "LoRA '0.5 x a'" in line
