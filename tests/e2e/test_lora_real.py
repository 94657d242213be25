"""LoRA on the default model (SmolLM2-135M-Instruct, GGUF Q4_1), with a random PEFT adapter made on
transformers' own reading of the file: in float32 every prompt token's log-probability is
transformers + PEFT's within 1e-4; in the default dtype (the file's blocks, the compiled layer stack
for base rows) a base request's entries are the same bits whether adapter rows share its steps or
not, and the shipped EAGLE head and draft model speculate with the adapter exactly as plain decoding
with it. (benchmarks/lora_demo.py trains a real adapter and shows the same at length.)"""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, LoRARequest, SamplingParams

from catalog_files import installed_file
from transformers_gguf import causal_lm_from_gguf

NAME = "smollm2-135m-instruct"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(installed_file(NAME) is None, reason=f"the {NAME} package is not installed")]

TEXT = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It is named after"
CHATS = [[{"role": "user", "content": q}] for q in ("Name three colours.", "What is a volcano?",
                                                   "Write a haiku about tea.")]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> tuple[LoRARequest, object]:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read a GGUF file")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(causal_lm_from_gguf(installed_file(NAME)),
                           LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                      target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    folder = str(tmp_path_factory.mktemp("real-lora"))
    model.save_pretrained(folder)
    return LoRARequest("random", 1, folder), model.eval()


def entries_of(llm, prompt, lora=None) -> list[float]:
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False,
                         lora_request=lora)
    return [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i]


def test_prompt_logprobs_with_the_adapter_are_transformers_with_peft(adapter):
    lora, peft_model = adapter
    llm = LLM(model=None, dtype="float32", max_model_len=256, kv_cache_memory=1 << 26, enable_lora=True)
    ids = llm.get_tokenizer()(TEXT)["input_ids"]
    ours, base = entries_of(llm, ids, lora), entries_of(llm, ids)
    with torch.no_grad():
        lps = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    theirs = lps.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    assert max(abs(a - b) for a, b in zip(ours, base)) > 0.05          # the adapter matters


def test_adapter_rows_never_change_a_base_request_and_speculation_stays_exact(adapter):
    lora, _ = adapter
    greedy = SamplingParams(temperature=0, max_tokens=32, logprobs=0)
    plain = LLM(model=None, max_model_len=512, kv_cache_memory=1 << 26, enable_lora=True)
    alone = plain.chat(CHATS, greedy, use_tqdm=False)
    with_adapter = plain.chat(CHATS + CHATS, greedy, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    for a, b in zip(alone, with_adapter[3:]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == \
            [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
    want = [o.outputs[0].token_ids for o in with_adapter[:3]]
    assert want != [o.outputs[0].token_ids for o in alone]
    for method in ("eagle", "draft_model"):
        specd = LLM(model=None, max_model_len=512, kv_cache_memory=1 << 26, enable_lora=True,
                    speculative_config={"method": method, "num_speculative_tokens": 3})
        got = specd.chat(CHATS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False, lora_request=lora)
        assert [o.outputs[0].token_ids for o in got] == want, method
