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


def test_lm_head_keeps_chosen_tokens_logits_in_their_order():
    torch.manual_seed(0)
    head = ParallelLMHead(50, 16)
    head.load(torch.randn(50, 16))
    hidden = torch.randn(3, 16)
    ids = torch.tensor([7, 3, 49, 0, 21])
    want = head.compute_logits(hidden)[:, ids]
    head.keep_tokens(ids)
    got = head.compute_logits(hidden)
    assert got.shape == (3, 5)
    # The same rows in the chosen order (a matmul over 5 rows may round apart from one over 50
    # where the BLAS blocks them otherwise, as on CPUs without AMX: not bit for bit).
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="must be in"):
        head.keep_tokens(torch.tensor([5]))          # only 5 rows are left: ids 0..4


def test_a_quantized_head_keeps_chosen_tokens_bit_for_bit():
    from gguf import GGMLQuantizationType

    from specserve.bench.suites.kernels import random_blocks
    from specserve.model_executor.layers import quant_gemm
    from specserve.model_executor.layers.quantized import QuantizedMatrix

    if not quant_gemm.available():
        pytest.skip("the quantized matmul kernel did not build here")
    qtype = int(GGMLQuantizationType.Q8_0)
    head = ParallelLMHead(40, 64)
    head.load(QuantizedMatrix.from_blocks(random_blocks("Q8_0", 40, 64), qtype, 64))
    x = torch.randn(2, 64)
    ids = torch.tensor([39, 0, 12, 5])
    want = head.compute_logits(x)[:, ids]
    head.keep_tokens(ids)
    assert head.quantized.shape[0] == 4 and torch.equal(head.compute_logits(x), want)
