"""Embeddings of the default model (GGUF Q4_1): in float32 the pooled final hidden states equal
transformers' on the same file (within 1e-4), for mean and last pooling; in the default dtype (the
file's blocks) paraphrases are nearer each other than sentences on another subject."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM

from catalog_files import installed_file
from transformers_gguf import causal_lm_from_gguf

NAME = "smollm2-135m-instruct"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(installed_file(NAME) is None, reason=f"the {NAME} package is not installed")]

TEXTS = ["A small cat is sleeping on the sofa.", "A kitten naps on the couch.",
         "The stock market fell sharply today.", "Shares dropped a lot on Wall Street."]


def test_pooled_states_are_transformers_on_the_same_file():
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read a GGUF file")
    hf = causal_lm_from_gguf(installed_file(NAME))
    for pooling in ("mean", "last"):
        llm = LLM(model=None, dtype="float32", max_model_len=256, kv_cache_memory=1 << 26, pooling=pooling)
        for out in llm.embed(TEXTS):
            with torch.no_grad():
                h = hf.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]     # [T, hidden]
            want = torch.nn.functional.normalize(h.mean(0) if pooling == "mean" else h[-1], dim=0)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=0)


def test_paraphrases_are_nearer_than_other_subjects():
    llm = LLM(model=None, max_model_len=256, kv_cache_memory=1 << 26, pooling="mean")
    v = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])             # [4, hidden], unit length
    sim = v @ v.T
    assert min(sim[0, 1], sim[2, 3]) > max(sim[0, 2], sim[0, 3], sim[1, 2], sim[1, 3])
