"""Embeddings (engine/embedding.py): a prompt's final hidden states pooled (last, mean, cls) and
normalized equal transformers' on the same model, whether the prompt runs in one piece or in
chunks; they leave no block held and no cached prefix, and run beside decoding requests without
changing them; bad input is refused."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "The cat sat on the mat and looked at the dog for a long time, then went to sleep."


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, default_model_tokenizer):
    from transformers import AutoModelForCausalLM

    ids = default_model_tokenizer.encode(TEXT)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0]            # [T, hidden], after the final norm
    return ids, {"last": h[-1], "mean": h.mean(0), "cls": h[0]}


@pytest.mark.parametrize("chunk", [2048, 7])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_states_equal_transformers(tiny_llama_dir, reference, pooling, chunk):
    ids, want = reference
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=1 << 22,
              max_num_batched_tokens=chunk, pooling=pooling)
    [out] = llm.embed(ids)
    got = torch.tensor(out.outputs.embedding)
    torch.testing.assert_close(got, torch.nn.functional.normalize(want[pooling], dim=0), atol=1e-5, rtol=0)
    raw = torch.tensor(llm.embed(ids, normalize=False)[0].outputs.embedding)
    torch.testing.assert_close(raw, want[pooling], atol=1e-4, rtol=1e-4)
    assert out.prompt_token_ids == ids
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and llm.engine.get_prefix_cache_stats()["queries"] == 0


def test_embedding_between_steps_changes_no_running_request(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = llm.generate(["Hello there", "Once upon a time"], params)
    eng = llm.engine
    for p in ("Hello there", "Once upon a time"):
        eng.add_request(p, params)
    outs, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        steps += 1
        if steps % 3 == 0:
            eng.embed(TEXT)
    assert sorted(outs.values()) == sorted(o.outputs[0].token_ids for o in want)


def test_bad_input_is_refused(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="empty"):
        llm.embed("")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([5] * 80)
    with pytest.raises(ValueError, match="pooling"):
        llm.embed("hi", pooling="max")
    with pytest.raises(ValueError, match="pooling must be"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=1 << 22, pooling="sum")
