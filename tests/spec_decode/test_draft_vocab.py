"""draft_vocab_size: validated in the config, and an LM head cut to the first N token ids."""
from __future__ import annotations

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.model_executor.layers.vocab import ParallelLMHead


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "100"])
def test_draft_vocab_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig(method="draft_model", model="/some/draft", draft_vocab_size=bad)


def test_draft_vocab_size_is_a_draft_model_option():
    with pytest.raises(ValueError, match="draft_model option"):
        SpeculativeConfig(method="ngram", draft_vocab_size=100)
    assert SpeculativeConfig(model="/some/draft", draft_vocab_size=100).draft_vocab_size == 100


def test_lm_head_keeps_the_first_tokens_logits():
    torch.manual_seed(0)
    full = torch.randn(50, 16)
    head = ParallelLMHead(50, 16)
    head.load(full)
    hidden = torch.randn(3, 16)
    want = head.compute_logits(hidden)[:, :20]
    head.keep_first_tokens(20)
    got = head.compute_logits(hidden)
    assert got.shape == (3, 20)
    torch.testing.assert_close(got, want)
