"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``: perplexity, log-likelihood
evaluations) on the default model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers on the
same file (``gguf_file=``, dequantized, float32): every prompt token's log-probability within
1e-4 (float32 sums from different kernels; measured 1.5e-5), the same perplexity to 3 digits; in the default
dtype (the file's blocks), the same entries bit for bit with the shipped draft model and
EAGLE head speculating, and with the prompt's blocks in the prefix cache."""
from __future__ import annotations

import math

import pytest
import torch

from specserve import LLM, SamplingParams

from catalog_files import installed_file
from transformers_gguf import causal_lm_from_gguf

NAME = "smollm2-135m-instruct"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(installed_file(NAME) is None, reason=f"the {NAME} package is not installed")]

TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
        "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
        "Locally nicknamed \"La dame de fer\", it was constructed as the centerpiece of the 1889 World's Fair.")


def entries_of(llm, prompt, **kw) -> list[float]:
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, **kw), use_tqdm=False)
    return [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i]


def test_prompt_logprobs_are_transformers_on_the_same_file():
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read a GGUF file")
    llm = LLM(model=None, dtype="float32", max_model_len=512, kv_cache_memory=1 << 26)
    ids = llm.get_tokenizer()(TEXT)["input_ids"]
    ours = entries_of(llm, ids)
    hf = causal_lm_from_gguf(installed_file(NAME))
    with torch.no_grad():
        lps = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    theirs = lps.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst < 1e-4
    ppl_ours, ppl_theirs = (math.exp(-sum(x) / len(x)) for x in (ours, theirs))
    assert ppl_ours == pytest.approx(ppl_theirs, rel=1e-3)
    print(f"{len(ids)} tokens: perplexity {ppl_ours:.3f} (transformers {ppl_theirs:.3f}); largest difference {worst:.1e}")


@pytest.mark.parametrize("spec", ["draft_model", "eagle"])
def test_speculation_and_the_prefix_cache_leave_the_entries_bit_for_bit(spec):
    plain = LLM(model=None, max_model_len=512, kv_cache_memory=1 << 26)
    specd = LLM(model=None, max_model_len=512, kv_cache_memory=1 << 26,     # the shipped draft / EAGLE head
                speculative_config={"method": spec, "num_speculative_tokens": 3})
    ids = plain.get_tokenizer()(TEXT)["input_ids"]
    want = entries_of(plain, ids)
    specd.generate(ids, SamplingParams(max_tokens=4), use_tqdm=False)      # its blocks now cached
    assert entries_of(specd, ids) == want
