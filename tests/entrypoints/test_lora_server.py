"""LoRA adapters over HTTP (vLLM's --lora-modules and runtime endpoints): ``model`` names the
adapter and the answer carries the name back; /v1/models lists adapters with their parent; a bad
adapter is a 400 (or stops the start); load and unload at runtime only where allowed."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from specserve import LLM, LoRARequest, SamplingParams
from specserve.entrypoints.openai.api_server import build_app

from lora_adapters import write_peft_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, peaked_llama_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-loras")
    return {name: write_peft_adapter(peaked_llama_dir, str(root / name), seed=seed)
            for name, seed in (("pirate", 1), ("poet", 2))}


def make_llm(model_dir) -> LLM:
    return LLM(model=model_dir, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20, enable_lora=True,
               max_loras=2)


def test_model_names_the_adapter_and_answers_equal_the_llm_api(peaked_llama_dir, adapter_dirs):
    llm = make_llm(peaked_llama_dir)
    want = {name: llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8),
                               lora_request=LoRARequest(name, i + 1, path))[0].outputs[0].text
            for i, (name, path) in enumerate(sorted(adapter_dirs.items()))}
    base = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    server_llm = make_llm(peaked_llama_dir)
    app = build_app(server_llm, "tiny", lora_modules=sorted(adapter_dirs.items()))
    with TestClient(app) as tc:
        for name in ("pirate", "poet", "tiny"):
            r = tc.post("/v1/completions", json={"model": name, "prompt": "Hello there", "max_tokens": 8,
                                                 "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
            assert r.json()["choices"][0]["text"] == want.get(name, base)
        chunks = tc.post("/v1/chat/completions", json={"model": "poet", "stream": True, "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert '"model": "poet"' in chunks.text or '"model":"poet"' in chunks.text
        msg = tc.post("/v1/messages", json={"model": "pirate", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "hi"}]})
        assert msg.status_code == 200 and msg.json()["model"] == "pirate"
        resp = tc.post("/v1/responses", json={"model": "pirate", "input": "hi", "max_output_tokens": 4})
        assert resp.status_code == 200 and resp.json()["model"] == "pirate"
        metrics = tc.get("/metrics").text
        assert 'vllm:lora_requests_info{max_lora="2",model_name="tiny",running_lora_adapters="",' in metrics
        cards = {c["id"]: c for c in tc.get("/v1/models").json()["data"]}
        assert cards["pirate"]["parent"] == "tiny" and cards["pirate"]["root"] == adapter_dirs["pirate"]
        assert "parent" not in cards["tiny"]
        assert tc.get("/v1/models/poet").json()["parent"] == "tiny"
        missing = tc.post("/v1/completions", json={"model": "nobody", "prompt": "x", "max_tokens": 2})
        assert missing.status_code == 404 and "pirate" in missing.json()["error"]["message"]
        # runtime updating is off unless allowed
        assert tc.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"}).status_code == 404


def test_runtime_load_and_unload_when_allowed(peaked_llama_dir, adapter_dirs, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    llm = make_llm(peaked_llama_dir)
    with TestClient(build_app(llm, "tiny")) as tc:
        bad = tc.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        ok = tc.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": adapter_dirs["poet"]})
        assert ok.status_code == 200 and "added" in ok.text
        again = tc.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": adapter_dirs["poet"]})
        assert again.status_code == 400
        r = tc.post("/v1/completions", json={"model": "poet", "prompt": "Hello there", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["model"] == "poet"
        assert tc.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 200
        assert llm.engine.list_loras() == set()
        assert tc.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 404
        assert tc.post("/v1/completions", json={"model": "poet", "prompt": "x", "max_tokens": 2}).status_code == 404


def test_a_bad_module_stops_the_start_and_flags_parse(peaked_llama_dir, tmp_path):
    from specserve.entrypoints.cli import build_parser

    with pytest.raises(ValueError, match="--lora-modules broken="):
        build_app(make_llm(peaked_llama_dir), "tiny", lora_modules=[("broken", str(tmp_path))])
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                                      "--max-loras", "3", "--max-lora-rank", "64"])
    assert args.lora_modules == [("a", "/x"), ("b", "/y")] and args.max_loras == 3 and args.max_lora_rank == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "no-equals-sign"])


def test_without_enable_lora_a_named_module_is_refused(tiny_llama_dir, tmp_path):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="not enabled"):
        build_app(llm, "tiny", lora_modules=[("a", str(tmp_path))])


def test_llama_servers_lora_files_scales_and_endpoints(peaked_llama_dir, adapter_dirs):
    """serve --lora FILE (llama-server's): the adapter at scale 1 for requests that name none; a
    request's lora list sets its own scales (those left out: 0); GET/POST /lora-adapters; a model
    naming a --lora-modules adapter still picks that one."""
    from specserve.lora.request import LoRAMix

    llm = make_llm(peaked_llama_dir)
    pirate, poet = LoRARequest("pirate", 1, adapter_dirs["pirate"]), LoRARequest("poet", 2, adapter_dirs["poet"])
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = {"pirate": llm.generate("Hello there", greedy, lora_request=pirate)[0].outputs[0].text,
            "base": llm.generate("Hello there", greedy)[0].outputs[0].text,
            "half": llm.generate("Hello there", greedy, lora_request=LoRAMix(((pirate, 0.5),)))[0].outputs[0].text}
    app = build_app(make_llm(peaked_llama_dir), "tiny", lora_modules=[("poet", adapter_dirs["poet"])],
                    llama_loras=[(adapter_dirs["pirate"], 1.0)])
    body = {"prompt": "Hello there", "temperature": 0}
    with TestClient(app) as tc:
        assert tc.get("/lora-adapters").json() == [{"id": 0, "path": adapter_dirs["pirate"], "scale": 1.0}]
        assert tc.post("/v1/completions", json={**body, "max_tokens": 8}).json()["choices"][0]["text"] == want["pirate"]
        assert tc.post("/completion", json={**body, "n_predict": 8}).json()["content"] == want["pirate"]
        off = tc.post("/completion", json={**body, "n_predict": 8, "lora": [{"id": 0, "scale": 0.0}]})
        assert off.json()["content"] == want["base"]
        half = tc.post("/completion", json={**body, "n_predict": 8, "lora": [{"id": 0, "scale": 0.5}]})
        assert half.json()["content"] == want["half"]
        named = tc.post("/v1/completions", json={**body, "max_tokens": 8, "model": "poet"})
        assert named.json()["model"] == "poet"
        bad = tc.post("/completion", json={**body, "n_predict": 2, "lora": [{"id": 3, "scale": 1.0}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora"
        assert tc.post("/lora-adapters", json=[{"id": 0, "scale": 0}]).json() == {"success": True}
        assert tc.post("/v1/completions", json={**body, "max_tokens": 8}).json()["choices"][0]["text"] == want["base"]
        assert tc.post("/lora-adapters", json=[{"id": "x"}]).status_code == 400
        assert tc.post("/lora-adapters", json=[{"id": 0, "scale": 1e6}]).status_code == 400


def test_a_lora_list_without_lora_files_is_refused_and_the_flags_parse(tiny_llama_dir):
    from specserve.entrypoints.cli import build_parser
    from specserve.entrypoints.openai.serve import llama_loras_from_args

    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    with TestClient(build_app(llm, "tiny")) as tc:
        r = tc.post("/completion", json={"prompt": "x", "n_predict": 2, "lora": [{"id": 0, "scale": 1}]})
        assert r.status_code == 400 and "--lora" in r.json()["error"]["message"]
        assert tc.get("/lora-adapters").json() == []
    args = build_parser().parse_args(["serve", "--lora", "a.gguf", "--lora-scaled", "b.gguf", "0.5"])
    assert llama_loras_from_args(args) == [("a.gguf", 1.0), ("b.gguf", 0.5)]
    args = build_parser().parse_args(["serve", "--lora", "a.gguf", "--lora-init-without-apply"])
    assert llama_loras_from_args(args) == [("a.gguf", 0.0)]
