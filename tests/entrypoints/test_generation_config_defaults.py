"""A model's sampling defaults (its generation config; vLLM's ``generation_config``) reach every
request that leaves a field out: ``LLM.generate`` without params, the server's requests and
``specserve generate``'s flags; a field the request sets wins. Tiny random model, whose greedy
answer changes under repetition_penalty 2 (checked, so the tests can fail)."""
from __future__ import annotations

import json

import pytest

from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main
from specserve.entrypoints.openai.api_server import build_app

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [300 + i for i in range(40)]
ADVICE = {"temperature": 0.0, "repetition_penalty": 2.0, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def advice_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps(ADVICE))
    return str(folder)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, advice_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               generation_config=advice_dir)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """Token ids of the prompt's greedy answer with and without the penalty (5 tokens), from an
    engine without defaults."""
    plain = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
                generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()

    def answer(penalty):
        params = SamplingParams(temperature=0, repetition_penalty=penalty, max_tokens=5)
        return plain.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids

    with_penalty, without = answer(2.0), answer(1.0)
    assert with_penalty != without
    return {"advice": with_penalty, "no_penalty": without}


def test_the_library_takes_the_models_defaults_when_given_no_params(llm, expected):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 2.0, 5)
    assert llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids == expected["advice"]
    explicit = SamplingParams(temperature=0, max_tokens=5)   # params given: nothing of the model's added
    assert llm.generate(PROMPT, explicit, use_tqdm=False)[0].outputs[0].token_ids == expected["no_penalty"]


def test_overrides_go_on_top(tiny_llama_dir, advice_dir, expected):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
              generation_config=advice_dir, override_generation_config={"repetition_penalty": 1.0})
    assert llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids == expected["no_penalty"]


def test_a_bad_generation_config_fails_at_start_up(tiny_llama_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
            generation_config=str(tmp_path))


def test_the_server_fills_the_fields_a_request_leaves_out(llm, expected):
    decode = llm.get_tokenizer().decode
    with running_server(build_app(llm, "tiny")) as url:
        def completion(**fields):
            r = local_http.post(f"{url}/v1/completions", json={"prompt": PROMPT, **fields}, timeout=60)
            assert r.status_code == 200, r.text
            body = r.json()
            return body["choices"][0]["text"], body["usage"]["completion_tokens"]

        assert completion() == (decode(expected["advice"]), 5)   # completions' 16 tokens capped at the model's 5
        assert completion(repetition_penalty=1.0) == (decode(expected["no_penalty"]), 5)   # the request's value wins
        assert completion(max_tokens=3)[1] == 3
        chat = local_http.post(f"{url}/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60).json()
        assert chat["usage"]["completion_tokens"] == 5      # chat's default (what the context leaves), capped


def test_generate_flags_left_out_take_the_models_defaults(tiny_llama_dir, advice_dir, capsys):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
              generation_config=advice_dir)      # its own: the module's may be driven by a server
    text = llm.get_tokenizer().decode(PROMPT)
    advised = llm.generate(text, use_tqdm=False)[0].outputs[0].token_ids
    unpenalized = llm.generate(text, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0].token_ids
    assert advised != unpenalized
    base = ["generate", text, "--model", tiny_llama_dir, "--dtype", "float32", "--json", "--generation-config", advice_dir]
    for extra, want in (([], advised), (["--repetition-penalty", "1"], unpenalized)):
        assert main(base + extra) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == want


@pytest.mark.parametrize("flags, message", [(["--generation-config", "/nonexistent/folder"], "no folder holding"),
                                            (["--override-generation-config", '{"temp": 1}'], "unknown field 'temp'")])
def test_a_bad_generation_config_flag_is_a_clear_error(tiny_llama_dir, capsys, flags, message):
    assert main(["generate", "x", "--model", tiny_llama_dir] + flags) == 2
    assert message in capsys.readouterr().err
