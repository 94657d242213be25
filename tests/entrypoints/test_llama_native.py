"""llama-server's own endpoints (``/completion``, ``/infill``; ``openai/llama_native.py``) on tiny
random models: answers equal the OpenAI completions they mean, streams join to them, the infill
prompt is llama.cpp's, and the code-completion cut-offs, stop words, grammars, probabilities,
response fields and refusals behave as llama-server documents them."""
from __future__ import annotations

import asyncio
import copy
import json

import pytest
from fastapi.testclient import TestClient

from specserve import LLM
from specserve.entrypoints.fill_in_middle import fim_prompt, infill_prompt
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.llama_native import NativeRequest, _logit_bias
from specserve.entrypoints.openai.llama_native_answers import NativeAnswer, NativeAnswers, _only

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory=16 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    with TestClient(build_app(llm, "tiny")) as tc:
        yield tc


@pytest.fixture(scope="module")
def fim_client(tiny_fim_dir):
    llm = LLM(model=tiny_fim_dir, dtype="float32", max_model_len=512, kv_cache_memory=16 << 20)
    with TestClient(build_app(llm, "fim")) as tc:
        yield tc


def streamed(tc, path: str, body: dict) -> list[dict]:
    with tc.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_completion_is_the_openai_completion_it_means(client):
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "return_tokens": True}
    native = client.post("/completion", json=body).json()
    want = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    assert native["content"] == want["choices"][0]["text"] and native["stop"] is True
    assert native["tokens_predicted"] == len(native["tokens"]) == 12 and native["stop_type"] == "limit"
    assert native["tokens_evaluated"] == want["usage"]["prompt_tokens"]
    timings = native["timings"]
    assert timings["predicted_n"] == 12 and timings["prompt_n"] + timings["cache_n"] == native["tokens_evaluated"]
    assert timings["predicted_ms"] >= 0 and timings["prompt_ms"] > 0
    assert timings.get("draft_n", 0) >= timings.get("draft_n_accepted", 0)
    chunks = streamed(client, "/completion", body)
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks[:-1]) == chunks[-1]["content"] == native["content"]
    assert [t for c in chunks[:-1] for t in c["tokens"]] == native["tokens"]


def test_infill_prompt_is_llamas(fim_client, tiny_fim_dir):
    tok = fim_client.app.state.async_engine.engine.tokenizer
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "n_predict": 8,
            "temperature": 0}
    native = fim_client.post("/infill", json=body).json()
    want = fim_client.post("/v1/completions", json={"prompt": body["input_prefix"], "suffix": body["input_suffix"],
                                                    "max_tokens": 8, "temperature": 0}).json()
    assert native["content"] == want["choices"][0]["text"]
    assert native["prompt"] == tok.decode(fim_prompt(tok, body["input_prefix"], body["input_suffix"]))
    with_files = fim_client.post("/infill", json={**body, "prompt": "return", "input_extra": [
        {"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]}).json()
    # this tokenizer has a file separator but no repository marker: the file is simply put first
    assert with_files["prompt"].startswith("def sub(a, b):") and with_files["prompt"].endswith("<|fim_middle|>return")


def test_infill_prompt_layout_and_budget(default_model_tokenizer):
    tok = copy.deepcopy(default_model_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                                                          "<|repo_name|>", "<|file_sep|>"]})
    extra = [("a.py", "x = 1\n"), ("b.py", "y = 2\n")]
    whole = tok.decode(infill_prompt(tok, "pre", "suf", extra, "mid", budget=500))
    assert whole == ("<|repo_name|>myproject\n<|file_sep|>a.py\nx = 1\n<|file_sep|>b.py\ny = 2\n"
                     "<|file_sep|>filename\n<|fim_prefix|>pre<|fim_suffix|>suf<|fim_middle|>mid")
    tight = infill_prompt(tok, "pre", "suf", extra, "mid", budget=20)
    assert len(tight) == 20 and tok.decode(tight).endswith("<|fim_prefix|>pre<|fim_suffix|>suf<|fim_middle|>mid")
    assert "y = 2" in tok.decode(tight) and "x = 1" not in tok.decode(tight)     # the earliest file goes first
    ids = infill_prompt(tok, "a " * 4000, "b " * 4000, [], "mid", budget=10_000)
    pre, suf, mid = tok.convert_tokens_to_ids(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    # the prefix's last 3/4 of llama-server's 2,048-token batch, the suffix's first 1/4 less the middle and 2
    assert ids.index(suf) - ids.index(pre) - 1 == 1536 and ids.index(mid) - ids.index(suf) - 1 == 512 - 2 - 1
    assert tok.decode(ids[ids.index(pre) + 1:ids.index(suf)]).endswith("a ") and ids[ids.index(suf) + 1] != suf


def test_stop_words_grammar_and_probabilities(client):
    sampled = {"prompt": PROMPT, "n_predict": 16, "temperature": 1.0, "seed": 4}
    text = client.post("/completion", json=sampled).json()["content"]
    at = next(i for i in range(3, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stopped = client.post("/completion", json={**sampled, "stop": [text[at:at + 3]]}).json()
    assert (stopped["content"], stopped["stop_type"], stopped["stopping_word"]) == (text[:at], "word", text[at:at + 3])
    yes_no = client.post("/completion", json={"prompt": "Yes or no?", "n_predict": 8, "temperature": 0,
                                              "grammar": 'root ::= "yes" | "no"'}).json()
    assert yes_no["content"] in ("yes", "no") and yes_no["stop_type"] == "eos"
    probs = client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0, "n_probs": 3}).json()
    entries = probs["completion_probabilities"]
    assert len(entries) == 4 and all(len(e["top_logprobs"]) == 3 and e["id"] is not None for e in entries)
    assert "".join(e["token"] for e in entries) == probs["content"]


def test_n_predict_zero_warms_the_cache(client):
    prompt = "warm me up " * 12
    warm = client.post("/completion", json={"prompt": prompt, "n_predict": 0}).json()
    assert warm["content"] == "" and warm["tokens_predicted"] == 0
    after = client.post("/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0}).json()
    assert after["tokens_cached"] >= 16


@pytest.mark.parametrize("fields, param", [
    ({"mirostat": 2}, "mirostat"), ({"dry_multiplier": 0.8}, "dry_multiplier"), ({"typical_p": 0.5}, "typical_p"),
    ({"input_prefix": "x"}, "input_prefix"), ({"grammar": "root ::= \"a\"", "json_schema": {}}, "json_schema"),
    ({"prompt": ""}, "prompt"), ({"n_indent": -1}, "n_indent"),
    # errors of the completions request it becomes name llama-server's fields
    ({"n_probs": 1000}, "n_probs"), ({"repeat_penalty": 0}, "repeat_penalty"), ({"grammar": "root ::= ("}, "grammar"),
    ({"json_schema": {"type": "strin"}}, "json_schema"),
    ({"logit_bias": [[]]}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"), ({"logit_bias": [[[1], 2]]}, "logit_bias"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(client, fields, param):
    r = client.post("/completion", json={"prompt": PROMPT, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not r.json()["error"]["message"].startswith(("logprobs", "repetition_penalty", "structured_outputs"))


def test_infill_needs_a_fill_in_the_middle_model(client):
    r = client.post("/infill", json={"input_prefix": "def f():", "input_suffix": ""})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


def answer_of(req: NativeRequest, pieces: list[str], times: list[float]) -> NativeAnswer:
    """Feed ``pieces`` (one token each) at ``times`` (seconds) through NativeAnswer."""
    clock = iter([0.0] + times)
    state = NativeAnswers(serving=None, req=req, prompt="", clock=lambda: next(clock))

    async def source():
        for i, piece in enumerate(pieces):
            yield "data: " + json.dumps({"choices": [{"text": piece, "specserve": {"tokens": [{"id": i}]}}]}) + "\n\n"

    async def run():
        return [p async for p in state.pieces(source())]
    asyncio.run(run())
    return state.answers[0]


def test_n_indent_ends_at_a_line_indented_less():
    req = NativeRequest(prompt="x", n_indent=4)
    state = answer_of(req, [" return", " x\n", "    ", "y = 1\n", "z", " = 2\n"], [1.0] * 6)
    assert state.content == " return x\n    y = 1\n" and state.cut and state.has_new_line
    state = answer_of(req, [" a\n", "    b\n", "        c"], [1.0] * 3)
    assert state.content == " a\n    b\n        c" and not state.cut


def test_t_max_predict_ms_ends_after_a_new_line():
    req = NativeRequest(prompt="x", t_max_predict_ms=100)
    state = answer_of(req, ["a", "b", "c", "\n", "d", "e"], [1.0, 1.05, 1.2, 1.21, 1.22, 1.23])
    assert state.content == "abc\n" and state.cut          # the limit passed before the new line: ends after it


def test_logit_bias_forms_and_response_fields(default_model_tokenizer):
    tok = default_model_tokenizer
    hello = tok.encode("Hello", add_special_tokens=False)
    assert _logit_bias([[15, 1.5], ["Hello", False]], tok) == {"15": 1.5, **{str(t): -100.0 for t in hello}}
    assert _logit_bias({"15": 2.0}, tok) == {"15": 2.0}
    body = {"content": "x", "timings": {"predicted_n": 3}, "stop": True}
    assert _only(body, ["content", "timings/predicted_n", "missing"]) == {"content": "x", "timings/predicted_n": 3}


def test_n_cmpl_answers_several_completions(client):
    """llama.vscode asks for 3 (``n_cmpl``): the answer is a list, one object per completion,
    their texts the OpenAI completion's n samples; streamed, pieces and finals carry their index."""
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 1.0, "seed": 11, "n_cmpl": 3}
    answers = client.post("/completion", json=body).json()
    want = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11,
                                                "n": 3, "top_k": 40, "top_p": 0.95, "min_p": 0.05}).json()   # llama's defaults
    assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1, 2]
    assert [a["content"] for a in answers] == [c["text"] for c in sorted(want["choices"], key=lambda c: c["index"])]
    chunks = streamed(client, "/completion", body)
    finals = [c for c in chunks if c["stop"]]
    assert [f["index"] for f in finals] == [0, 1, 2] and [f["content"] for f in finals] == [a["content"] for a in answers]
    for i in range(3):
        assert "".join(c["content"] for c in chunks if not c["stop"] and c["index"] == i) == answers[i]["content"]
    lora = client.post("/infill", json={"input_prefix": "x", "lora": [{"id": 0, "scale": 0.5}]})
    assert lora.status_code == 400 and lora.json()["error"]["param"] == "lora"


def test_props_tell_the_context_size(client):
    props = client.get("/props").json()
    engine = client.app.state.async_engine.engine
    assert props["default_generation_settings"]["n_ctx"] == engine.max_model_len == 512
    assert props["total_slots"] == engine.config.max_num_seqs and props["model_alias"] == "tiny"
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
