"""``SamplingParams.truncate_prompt_tokens`` (vLLM's): a prompt keeps its last k tokens (-1: as
many as the context holds with one to generate), in the library and over HTTP, and then answers
as that shorter prompt does. Tiny random model."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 64
LONG = [(71 * i + 13) % 3000 + 200 for i in range(100)]   # longer than the context


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=8 << 20)


def run(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**{"temperature": 0, "max_tokens": 4, **kw}), use_tqdm=False)[0]


def test_the_last_tokens_are_kept_and_answer_as_that_prompt(llm):
    out = run(llm, LONG, truncate_prompt_tokens=20)
    assert out.prompt_token_ids == LONG[-20:]
    assert out.outputs[0].token_ids == run(llm, LONG[-20:]).outputs[0].token_ids
    whole = run(llm, LONG, truncate_prompt_tokens=-1, max_tokens=1)
    assert whole.prompt_token_ids == LONG[-(MAX_MODEL_LEN - 1):]
    short = run(llm, LONG[:10], truncate_prompt_tokens=20)
    assert short.prompt_token_ids == LONG[:10]
    text = run(llm, "one two three four five six seven", truncate_prompt_tokens=2)
    assert len(text.prompt_token_ids) == 2 and text.prompt is None
    with pytest.raises(ValueError, match="max_model_len"):
        run(llm, LONG)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "3"])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        SamplingParams(truncate_prompt_tokens=bad)

