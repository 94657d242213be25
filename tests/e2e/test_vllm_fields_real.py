"""vLLM's sampling fields on the default model (SmolLM2-135M-Instruct, its GGUF blocks): a short
answer held open by ``min_tokens``, an answer in digits only by ``allowed_token_ids``, and a
stop string kept by ``include_stop_str_in_output``, each the same token for token with the
shipped draft model and EAGLE head speculating as without."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

from catalog_files import installed_file

NAME = "smollm2-135m-instruct"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(installed_file(NAME) is None, reason=f"the {NAME} package is not installed")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engines():
    kw = dict(model=None, max_model_len=512, kv_cache_memory=1 << 26)
    return {"plain": LLM(**kw),
            "draft_model": LLM(**kw, speculative_config={"method": "draft_model", "num_speculative_tokens": 3}),
            "eagle": LLM(**kw, speculative_config={"method": "eagle", "num_speculative_tokens": 3})}


def answers(engines, params) -> dict[str, list[int]]:
    return {name: llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0].token_ids for name, llm in engines.items()}


def test_min_tokens_holds_a_short_answer_open(engines):
    eos = engines["plain"].get_tokenizer().eos_token_id
    short = answers(engines, SamplingParams(temperature=0, max_tokens=64))
    assert len(short["plain"]) < 20 and short["plain"][-1] == eos
    held = answers(engines, SamplingParams(temperature=0, max_tokens=64, min_tokens=30))
    assert len(held["plain"]) >= 30 and eos not in held["plain"][:30]
    assert held["draft_model"] == held["plain"] and held["eagle"] == held["plain"]


def test_allowed_token_ids_give_an_answer_in_digits(engines):
    tok = engines["plain"].get_tokenizer()
    digits = sorted({tok.convert_tokens_to_ids(str(d)) for d in range(10)})
    got = answers(engines, SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=digits))
    assert set(got["plain"]) <= set(digits) and tok.decode(got["plain"]).isdigit()
    assert got["draft_model"] == got["plain"] and got["eagle"] == got["plain"]
    seeded = answers(engines, SamplingParams(temperature=0.8, seed=2, max_tokens=12, allowed_token_ids=digits))
    assert seeded["draft_model"] == seeded["plain"] and seeded["eagle"] == seeded["plain"]


def test_a_kept_stop_string(engines):
    llm = engines["plain"]
    [out] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=64, stop=["Paris"],
                                              include_stop_str_in_output=True), use_tqdm=False)
    assert out.outputs[0].text.endswith("Paris") and out.outputs[0].stop_reason == "Paris"
