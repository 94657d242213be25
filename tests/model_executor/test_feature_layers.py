"""Feature layers (an EAGLE-3 head's features): the target's forward returns the residual stream
before the named layers after its final hidden state, equal to transformers' hidden states on a
tiny model, and on the default model's compiled CPU layers the same whether the layers run as one
call a run between feature layers or one call a layer."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def forward_rows(llm, ids: list[int]) -> torch.Tensor:
    from specserve.worker.model_runner import ForwardInput

    runner, kv = llm.engine.runner, llm.engine.kv_cache
    assert kv.allocate_slots("probe", len(ids))
    table = kv.block_table("probe")
    try:
        out = runner.execute([ForwardInput(token_ids=ids, start_position=0, block_table=table, num_logits=1)],
                             return_all_hidden=True)
    finally:
        llm.engine.kv_cache.free("probe")
    return out.all_hidden


def test_feature_rows_are_transformers_hidden_states(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    llm.engine.runner.set_feature_layers((1, 0, 1))
    ids = list(range(200, 212))
    rows = forward_rows(llm, ids)                                   # [T, H * 4]
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        states = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    h = ref.config.hidden_size
    for column, layer in enumerate((1, 0, 1), start=1):
        torch.testing.assert_close(rows[:, column * h:(column + 1) * h], states[layer][0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not among the target's"):
        llm.engine.runner.set_feature_layers((0, 7))


@pytest.mark.slow
def test_the_compiled_stack_cut_at_feature_layers_gives_the_layer_by_layer_rows():
    llm = LLM(max_model_len=128, kv_cache_memory=16 << 20)
    model = llm.engine.runner.model
    if model.layer_stack is None:
        pytest.skip("the compiled layer stack is not built on this machine")
    layers = (2, 15, 27)
    model.set_feature_layers(layers)
    ids = list(range(300, 340))
    segmented = forward_rows(llm, ids)
    stack, model.layer_stack = model.layer_stack, None                  # one call a layer
    try:
        layer_by_layer = forward_rows(llm, ids)
    finally:
        model.layer_stack = stack
    assert segmented.shape == layer_by_layer.shape == (len(ids), 4 * model.config.hidden_size)
    torch.testing.assert_close(segmented, layer_by_layer, rtol=1e-4, atol=1e-4)
