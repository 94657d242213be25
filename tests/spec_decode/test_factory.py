"""The draft model's start-up checks run on its config, before its weights load.

The drafts here are folders with a config and a tokenizer but no weights: a
check that waited for the weights would fail on the missing files instead.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import LlamaConfig

from specserve import LLM, catalog
from specserve.model_executor.loader import ModelNotFoundError, load_model
from specserve.spec_decode.factory import VocabularyMismatchError, check_draft_config

from model_cache import share_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def weightless_draft(folder, tiny_llama_dir, **config) -> str:
    """A Llama config (``config`` overriding the tiny target's) and the target's tokenizer, no weights."""
    base = LlamaConfig.from_pretrained(tiny_llama_dir).to_dict()
    LlamaConfig(**{**base, **config}).save_pretrained(folder)
    for name in os.listdir(tiny_llama_dir):   # the target's tokenizer files, as saved
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(os.path.join(tiny_llama_dir, name), folder)
    assert not any(n.endswith((".safetensors", ".bin")) for n in os.listdir(folder))
    return share_folder(str(folder))   # the start-up check and the load that follows read it once


def engine_with_draft(target: str, draft: str) -> LLM:
    return LLM(model=target, speculative_model=draft, num_speculative_tokens=2, dtype="float32",
               device="cpu", max_model_len=128, kv_cache_memory=1 << 22)


def test_another_vocabulary_goes_on_to_load_its_weights(tmp_path, tiny_llama_dir, caplog):
    """A draft with more token ids than the target (its tokenizer's, padded) is not refused: the
    check maps the vocabularies and selects the cross-vocabulary path, with a log line."""
    target_vocab = LlamaConfig.from_pretrained(tiny_llama_dir).vocab_size
    draft = weightless_draft(tmp_path / "draft", tiny_llama_dir, vocab_size=target_vocab + 64)
    with caplog.at_level("INFO", logger="specserve.spec_decode.checks"):
        with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):  # past the checks, at the weights
            engine_with_draft(tiny_llama_dir, draft)
    assert "drafting across vocabularies" in caplog.text


def test_no_usable_overlap_found_before_the_draft_weights(tmp_path, tiny_llama_dir):
    from cross_vocab_models import disjoint

    draft = weightless_draft(tmp_path / "draft", tiny_llama_dir, vocab_size=66)
    for name in os.listdir(draft):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            os.remove(os.path.join(draft, name))
    disjoint().save_pretrained(draft)
    with pytest.raises(VocabularyMismatchError, match="shares 0 of its 64 text tokens with the target's vocabulary"):
        engine_with_draft(tiny_llama_dir, draft)


def test_short_draft_context_found_before_the_draft_weights(tmp_path, tiny_llama_dir):
    draft = weightless_draft(tmp_path / "draft", tiny_llama_dir, max_position_embeddings=64)
    with pytest.raises(ValueError, match="the draft supports 64 positions, fewer than max_model_len=128"):
        engine_with_draft(tiny_llama_dir, draft)


def test_a_fitting_draft_goes_on_to_load_its_weights(tmp_path, tiny_llama_dir):
    draft = weightless_draft(tmp_path / "draft", tiny_llama_dir)
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):  # past the checks, at the weights
        engine_with_draft(tiny_llama_dir, draft)


@pytest.mark.slow
def test_real_pair_checked_on_metadata():
    """The catalog's 0.5B fits the 1.5B's vocabulary and not the default model's (skipped when absent)."""
    entry = catalog.lookup("qwen2.5-coder-0.5b-instruct")
    if catalog.verified_path(entry) is None and catalog.missing_packages(entry):
        pytest.skip(f"{entry.name} is not installed (optional; `{entry.install_command}`)")
    target = catalog.lookup("qwen2.5-coder-1.5b-instruct")
    assert check_draft_config(entry.name, target.vocab_size, 4096, torch.float16).mapping is None
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 151936 tokens but the target has 49152"):
        check_draft_config(entry.name, 49152, 4096, torch.float16)   # without the target's tokenizer: sizes only
    fit = check_draft_config(entry.name, 49152, 4096, torch.float16, load_model(None, torch.float32, False).tokenizer)
    assert fit.mapping is not None and fit.mapping.num_shared > 10_000   # SmolLM2's tokens mostly spelled alike
