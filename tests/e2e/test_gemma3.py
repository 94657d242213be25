"""The real Gemma 3 270M (catalog ``gemma-3-270m``, GGUF Q4_K_M): a family other than Llama/Qwen2,
with (1 + w) norms around both branches, q/k norms, GELU-tanh, scaled embeddings and sliding-window
layers (512 tokens) interleaved with global ones of another rotary base.

Skipped with the reason when its PyPI packages are absent (docs/models.md says how to install
them); the default install and CI do not need them.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import LLM, SamplingParams

from catalog_files import installed_file
from transformers_gguf import causal_lm_from_gguf

NAME = "gemma-3-270m"


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(installed_file(NAME) is None, reason=f"the {NAME} packages are not installed (docs/models.md)")]

WINDOW = 512


@pytest.fixture(scope="module")
def long_prompts() -> list[str]:
    """The shipped bench questions longer than the sliding window (rag and summarization)."""
    import specserve.bench as bench

    with open(os.path.join(os.path.dirname(bench.__file__), "prompts.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["turns"][0] for r in rows if len(r["turns"][0]) > 2600][:3]


def test_greedy_tokens_equal_transformers_on_the_same_file_past_the_window(long_prompts):
    """specserve in float32 against transformers loading the same GGUF (``gguf_file=``, dequantized,
    float32): up to 24 greedy tokens (transformers stops at end-of-sequence) after prompts longer
    than the 512-token window."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read a GGUF file")
    from transformers import GenerationConfig

    llm = LLM(model=NAME, dtype="float32", max_model_len=2048, kv_cache_memory=1 << 27)
    tok = llm.engine.tokenizer
    prompts = [tok.encode(p, add_special_tokens=True) for p in long_prompts]
    assert all(len(p) > WINDOW for p in prompts), [len(p) for p in prompts]
    ours = [o.outputs[0].token_ids
            for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    del llm
    hf = causal_lm_from_gguf(installed_file(NAME))
    with torch.no_grad():
        for ids, got in zip(prompts, ours):
            ref = hf.generate(torch.tensor([ids]), generation_config=GenerationConfig(
                max_new_tokens=24, do_sample=False, pad_token_id=0))[0, len(ids):].tolist()
            # transformers stops at end-of-sequence; specserve (ignore_eos) goes on past it
            assert got[:len(ref)] == ref and (len(ref) == 24 or ref[-1] == tok.eos_token_id)



def test_greedy_ngram_speculation_equals_plain_in_the_default_dtype(long_prompts):
    """The file's own blocks through the compiled layers: n-gram drafts change no token."""
    kw = dict(model=NAME, max_model_len=2048, kv_cache_memory=1 << 27)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(**kw).generate(long_prompts, params)]
    llm = LLM(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in llm.generate(long_prompts, params)] == plain
    assert llm.get_spec_decode_stats().num_accepted_tokens > 0


def test_chat_without_a_template_is_a_clear_error_and_completions_work():
    llm = LLM(model=NAME, max_model_len=256, kv_cache_memory=1 << 24)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert "capital" in out[0].outputs[0].text or "Paris" in out[0].outputs[0].text
