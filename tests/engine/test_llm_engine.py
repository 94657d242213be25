"""Engine-level speculation switches, on a tiny random model (seconds, no real weights)."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

PROMPTS = ["one two three one two three one two", "a b c a b c a b"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)


def spec_llm(model_dir, **extra):
    return LLM(
        model=model_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, **extra},
    )


def test_disable_by_batch_size_skips_drafting_in_large_batches(tiny_llama_dir, plain):
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = spec_llm(tiny_llama_dir, disable_by_batch_size=2)
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in batched] == expected
    # Both requests decode together until the end: no step drafted anything.
    assert llm.get_spec_decode_stats().num_draft_tokens == 0
    alone = llm.generate(PROMPTS[0], GREEDY)[0]
    assert alone.outputs[0].token_ids == expected[0]
    assert alone.spec_decode_stats.num_draft_tokens > 0  # batch of 1 is below the limit


def test_disable_by_batch_size_is_validated(tiny_llama_dir):
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        spec_llm(tiny_llama_dir, disable_by_batch_size=0)


def test_generate_builds_only_final_outputs_and_streams_still_get_every_step(plain, monkeypatch):
    """LLM.generate reads finished outputs only, so its steps build no others (step(stream_outputs=
    False)); driving step() directly, as AsyncLLMEngine does, still yields one output a step per
    request, and both end with the same tokens and text."""
    engine = plain.engine
    built = []
    real = engine.output_processor.make_output
    monkeypatch.setattr(engine.output_processor, "make_output", lambda req, *a: built.append(req) or real(req, *a))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    final = plain.generate(PROMPTS, params)
    assert len(built) == 2                                                # the two finished ones
    built.clear()
    for p in PROMPTS:
        engine.add_request(p, params)
    streamed = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(out)
    assert len(built) == 16 and all(len(v) == 8 for v in streamed.values())
    last = [v[-1] for v in streamed.values()]
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in last] == \
        [(o.outputs[0].token_ids, o.outputs[0].text) for o in final]
