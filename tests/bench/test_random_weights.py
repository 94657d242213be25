"""Published shapes with random weights (bench/random_weights.py), as forward-rows times them on GPUs."""
from __future__ import annotations

import pytest
import torch

from specserve.bench import random_weights
from specserve.bench.suites.forward_rows import step_input
from specserve.model_executor.models.decoder_spec import spec_for


@pytest.mark.parametrize("name", list(random_weights.SHAPES))
def test_every_shape_is_a_config_specserve_runs(name):
    config = random_weights.shape_config(name)
    spec_for(config)   # raises for a family or option the decoder does not run


def test_a_random_runner_runs_and_streams_what_it_holds():
    runner = random_weights.random_runner("tiny", torch.float32, "cpu", max_model_len=256, kv_cache_memory=1 << 20)
    out = runner.execute(step_input(3, 20))
    assert out.logits.shape == (3, 512) and torch.isfinite(out.logits).all()
    config = random_weights.shape_config("tiny")
    per_layer = 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64)   # q, k, v, o, MLP, two norms
    head = 4 * 512 * 64                                                         # tied: the LM head, once
    assert random_weights.streamed_bytes(runner.model) == config.num_hidden_layers * per_layer + head + 4 * 64


def test_unknown_shapes_are_named():
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        random_weights.shape_config("llama-9")
