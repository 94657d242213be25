"""Fill in the middle (``suffix`` on /v1/completions, ``generate --suffix``): the prompt is the
model's prefix-suffix-middle order built from the markers' ids (marker text in the user's code
stays text), the middle ends at the model's end-of-middle tokens, and a model without the
markers is a clear 400. A tiny random model whose tokenizer has Qwen2.5-Coder's markers added
(conftest's tiny_fim_dir)."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main
from specserve.entrypoints.fill_in_middle import fim_params, fim_prompt, fim_tokens
from specserve.entrypoints.openai.api_server import build_app

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def llm(tiny_fim_dir):
    return LLM(model=tiny_fim_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_the_prompt_is_prefix_suffix_middle_by_the_markers_ids(llm, default_model_tokenizer):
    tok = llm.get_tokenizer()
    marks = fim_tokens(tok)
    ids = fim_prompt(tok, PREFIX, SUFFIX)
    enc = lambda t: tok.encode(t, add_special_tokens=False, split_special_tokens=True)   # noqa: E731
    assert ids == [marks.prefix, *enc(PREFIX), marks.suffix, *enc(SUFFIX), marks.middle]
    assert {tok.convert_tokens_to_ids(m) for m in ("<|fim_pad|>", "<|file_sep|>")} <= set(marks.ends)
    sneaky = fim_prompt(tok, "x = '<|fim_suffix|>'", "")
    assert sneaky.count(marks.suffix) == 1                      # the user's marker text stays text
    assert set(marks.ends) <= set(fim_params(tok, SamplingParams(stop_token_ids=[5])).stop_token_ids)
    assert fim_tokens(default_model_tokenizer) is None
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens"):
        fim_prompt(default_model_tokenizer, "a", "b")


def test_the_server_fills_the_middle(llm, tiny_fim_dir):
    tok = llm.get_tokenizer()
    params = fim_params(tok, SamplingParams(temperature=0, max_tokens=12))
    want = llm.generate(fim_prompt(tok, PREFIX, SUFFIX), params, use_tqdm=False)[0].outputs[0]
    served = LLM(model=tiny_fim_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    with running_server(build_app(served, "tiny")) as url:
        body = {"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 12, "temperature": 0}
        r = local_http.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        assert r.json()["usage"]["prompt_tokens"] == len(fim_prompt(tok, PREFIX, SUFFIX))
        for bad in (dict(body, prompt=[5, 6]), dict(body, echo=True)):
            r = local_http.post(f"{url}/v1/completions", json=bad, timeout=60)
            assert r.status_code == 400, r.text


def test_generate_suffix(tiny_fim_dir, capsys):
    assert main(["generate", PREFIX, "--suffix", SUFFIX, "--model", tiny_fim_dir, "--dtype", "float32", "--max-tokens", "4",
                 "--kv-cache-memory", str(8 << 20), "--json"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
    with pytest.raises(SystemExit, match="cannot go with --chat"):
        main(["generate", PREFIX, "--suffix", SUFFIX, "--chat", "--model", tiny_fim_dir])
