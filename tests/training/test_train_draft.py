"""`specserve train-draft` end to end on a tiny random target, for both draft kinds.

The tiny target has the default model's tokenizer (so the chat template and
vocabulary are real) but 2 layers of width 64, so generating a few answers and
training for a few steps takes seconds.
"""
from __future__ import annotations

import json
import os

import pytest
from transformers import LlamaForCausalLM

from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main as cli_main
from specserve.model_executor.models.eagle import EAGLE_CONFIG_NAME, EagleConfig
from specserve.training.prompts import PROMPTS_FILE, build_prompts, load_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_target(tiny_llama_dir) -> str:
    """conftest's tiny Llama (the default model's tokenizer, 2 layers of width 64, seed 0)."""
    return tiny_llama_dir


COMMON = ["--num-prompts", "4", "--max-tokens", "12", "--gen-batch-size", "2", "--epochs", "2",
          "--batch-tokens", "256", "--device", "cpu", "--draft-vocab-size", "512"]


def test_shipped_prompt_set_is_the_generated_one():
    shipped = load_prompts()
    assert [p["prompt"] for p in shipped] == [p["prompt"] for p in build_prompts()]
    assert {p["category"] for p in shipped} == {"chat", "qa", "code", "summarization", "math"}
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "prompts", "default.jsonl")
    if os.path.isfile(bench):  # held out: no benchmark prompt is a training prompt
        assert not {p["prompt"] for p in load_prompts(bench)} & {p["prompt"] for p in shipped}
    assert os.path.isfile(PROMPTS_FILE)


def test_train_draft_model_end_to_end(tiny_target, tmp_path):
    out = str(tmp_path / "draft")
    data = str(tmp_path / "data")
    rc = cli_main(["train-draft", "--target", tiny_target, "--method", "draft_model", "--out", out,
                   "--data-dir", data, "--num-layers", "1", "--hidden-size", "32", "--profile", *COMMON])
    assert rc == 0
    info = json.load(open(os.path.join(out, "training.json")))
    assert info["complete"] and len(info["history"]) == 2
    assert set(info["profile"]) == {"draft_vocab", "full_vocab", "no_lm_head"}
    # A plain Hugging Face folder: transformers loads it...
    draft = LlamaForCausalLM.from_pretrained(out)
    assert draft.config.num_hidden_layers == 1 and draft.config.hidden_size == 32
    # ... and it drafts for the target in specserve; greedy output is the target's own.
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=tiny_target, dtype="float32", device="cpu", kv_cache_memory=16 << 20).generate(
        "Hello there", params)[0]
    spec_llm = LLM(model=tiny_target, dtype="float32", device="cpu", kv_cache_memory=16 << 20,
                   speculative_model=out, num_speculative_tokens=3)
    spec = spec_llm.generate("Hello there", params)[0]
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec_llm.get_spec_decode_stats().num_draft_tokens > 0


def test_train_eagle_end_to_end_and_resume(tiny_target, tmp_path):
    out = str(tmp_path / "eagle")
    work = str(tmp_path / "work")
    rc = cli_main(["train-draft", "--target", tiny_target, "--method", "eagle", "--out", out,
                   "--work-dir", work, *COMMON])
    assert rc == 0
    config = EagleConfig.load(out)
    assert config.draft_vocab_size == 512 and config.vocab_size == 49152
    assert os.path.isfile(os.path.join(out, EAGLE_CONFIG_NAME))
    assert os.path.isfile(os.path.join(work, "checkpoint.pt"))
    # --resume with more epochs continues from the checkpoint (the data is reused, not regenerated).
    rc = cli_main(["train-draft", "--target", tiny_target, "--method", "eagle", "--out", out,
                   "--work-dir", work, "--resume", *COMMON[:-6], "--epochs", "3", *COMMON[-6:-4], *COMMON[-4:]])
    assert rc == 0
    info = json.load(open(os.path.join(out, "training.json")))
    assert [h["epoch"] for h in info["history"]] == [0, 1, 2]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=tiny_target, dtype="float32", device="cpu", kv_cache_memory=16 << 20).generate(
        ["Hi", "Tell me a story"], params)
    llm = LLM(model=tiny_target, dtype="float32", device="cpu", kv_cache_memory=16 << 20,
              speculative_config={"method": "eagle", "model": out, "num_speculative_tokens": 3})
    spec = llm.generate(["Hi", "Tell me a story"], params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_spec_decode_stats().num_draft_tokens > 0


def test_train_eagle3_end_to_end(tmp_path, default_model_tokenizer):
    """An EAGLE-3 head trained on a 6-layer tiny target (its feature layers recorded beside the final
    hidden state), saved in vLLM's format; it drafts for the target and greedy output is the target's."""
    from safetensors.torch import load_file

    from tiny_models import write_tiny_llama

    target = write_tiny_llama(str(tmp_path / "target"), seed=3, tokenizer=default_model_tokenizer,
                              embedding_scale=8.0, num_layers=6)
    out = str(tmp_path / "eagle3")
    rc = cli_main(["train-draft", "--target", target, "--method", "eagle3", "--out", out, "--unroll-steps", "2",
                   "--feature-layers", "1,3,4", *COMMON])
    assert rc == 0
    info = json.load(open(os.path.join(out, "training.json")))
    assert info["complete"] and info["feature_layers"] == [1, 3, 4] and "eval_agree2" in info["history"][-1]
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 3 * 64) and weights["midlayer.self_attn.q_proj.weight"].shape[1] == 128
    assert weights["lm_head.weight"].shape[0] == 512 == weights["d2t"].shape[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(model=target, dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    plain = LLM(**kw).generate("Hello there", params)[0]
    spec_llm = LLM(**kw, speculative_config={"method": "eagle3", "model": out, "num_speculative_tokens": 3})
    assert spec_llm.engine.runner.model.feature_layers == (1, 3, 4)
    assert spec_llm.generate("Hello there", params)[0].outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="holds the features of layers"):    # eagle's data is not eagle3's
        from specserve.training.data import generate_dataset
        from specserve.training.prompts import load_prompts as prompts_of

        generate_dataset(target, prompts_of(None, 4), os.path.join(out, "train-work", "data"), max_tokens=12,
                         batch_size=2, device="cpu")


def test_speculation_without_a_draft_on_another_target_is_a_clear_error(tiny_target):
    for method in ("eagle", "draft_model"):
        with pytest.raises(ValueError, match="train-draft"):
            LLM(model=tiny_target, dtype="float32", device="cpu", kv_cache_memory=16 << 20,
                speculative_config={"method": method})
