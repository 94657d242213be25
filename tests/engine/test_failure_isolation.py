"""Failure isolation: one request's exception finishes that request
with an error and the others carry on with the tokens they get alone; a failed
forward fails only the requests of that step; a failed proposer means plain
decoding. Faults are injected by the tests (monkeypatching), never by a hook in
production code. Tiny random model: seconds."""
from __future__ import annotations

import asyncio

import pytest

import specserve.sample.verify as verify_module
from specserve import LLM, SamplingParams
from specserve.engine.async_engine import AsyncLLMEngine, EngineStepError, RequestFailedError
from specserve.engine.llm_engine import StepFailedError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["one two three one two three one two", "a b c a b c a b", "the cat sat on the mat the cat"]


def make_llm(model_dir, spec: bool, **kw) -> LLM:
    extra = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if spec else {}
    return LLM(model=model_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, **extra, **kw)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "ngram"])
def llm(request, tiny_llama_dir):
    return make_llm(tiny_llama_dir, request.param)


def idle(llm) -> bool:
    e = llm.engine
    return not e.has_unfinished_requests() and e.kv_cache.num_free_blocks == e.kv_cache.num_blocks


def run_all(engine, ids) -> dict:
    finished = {}
    while set(ids) - finished.keys():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def params_for(i: int, greedy: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True)


def alone(llm, greedy: bool) -> list[list[int]]:
    return [llm.generate(p, params_for(i, greedy))[0].outputs[0].token_ids for i, p in enumerate(PROMPTS)]


def stream_all_greedy(async_engine: AsyncLLMEngine) -> list:
    """Every prompt at once through the async engine, greedy; then shut it down.
    Per prompt: its tokens, or the exception its stream raised."""
    async def one(i):
        out = None
        async for out in async_engine.generate(PROMPTS[i], params_for(i, True)):
            pass
        return out.outputs[0].token_ids

    async def run():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))), return_exceptions=True)

    try:
        return asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        async_engine.shutdown()


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_a_request_failing_in_its_output_handling_does_not_hurt_the_others(llm, monkeypatch, greedy):
    expected = alone(llm, greedy)
    engine = llm.engine
    real_append = engine.output_processor.append
    calls = {"n": 0}

    def append(req, token):
        if req.request_id == "bad":
            calls["n"] += 1
            if calls["n"] == 3:  # after a few tokens, mid-generation
                raise RuntimeError("injected fault")
        return real_append(req, token)

    monkeypatch.setattr(engine.output_processor, "append", append)
    ids = []
    for i, p in enumerate(PROMPTS):
        ids.append(engine.add_request(p, params_for(i, greedy), request_id="bad" if i == 1 else f"ok{i}"))
    outs = run_all(engine, ids)
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert "injected fault" in str(engine.take_request_error("bad"))
    assert engine.take_request_error("bad") is None   # handed out once
    assert outs["ok0"].outputs[0].token_ids == expected[0]
    assert outs["ok2"].outputs[0].token_ids == expected[2]
    assert idle(llm)


def test_a_fault_after_the_batch_drew_its_random_numbers_leaves_the_others_their_tokens(llm, monkeypatch):
    """The batched sampler fails after every request drew its random numbers; each request is
    then verified alone, and draws the same numbers again (they are keyed by its seed and
    output index, not taken from a running generator), so seeded outputs are unchanged."""
    expected = alone(llm, greedy=False)
    engine = llm.engine
    real_choices = verify_module.target_choices
    bad = {}

    def failing_choices(logits, row_params, row_generators):
        out = real_choices(logits, row_params, row_generators)   # draws happen
        if any(p is bad["params"] for p in row_params):
            raise RuntimeError("injected sampling fault")
        return out

    monkeypatch.setattr(verify_module, "target_choices", failing_choices)
    ids = [engine.add_request(p, params_for(i, False), request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    bad["params"] = engine.requests["r1"].sampling_params
    outs = run_all(engine, ids)
    assert outs["r1"].outputs[0].finish_reason == "error"
    assert "injected sampling fault" in str(engine.take_request_error("r1"))
    assert outs["r0"].outputs[0].token_ids == expected[0]
    assert outs["r2"].outputs[0].token_ids == expected[2]
    assert idle(llm)


def test_a_failed_forward_fails_only_the_requests_of_that_step(tiny_llama_dir, monkeypatch):
    llm = make_llm(tiny_llama_dir, spec=False, max_num_seqs=2)
    engine = llm.engine
    expected = alone(llm, greedy=True)
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def execute(inputs, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected device fault")
        return real_execute(inputs, **kw)

    monkeypatch.setattr(engine.runner, "execute", execute)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params_for(i, True), request_id=f"r{i}")
    engine.step()
    with pytest.raises(StepFailedError) as info:
        engine.step()
    assert sorted(info.value.request_ids) == ["r0", "r1"]     # r2 waited: max_num_seqs=2
    for rid in info.value.request_ids:
        engine.abort_request(rid)
    outs = run_all(engine, ["r2"])
    assert outs["r2"].outputs[0].token_ids == expected[2]
    assert idle(llm)


def test_a_failing_proposer_means_plain_decoding_with_the_same_tokens(tiny_llama_dir, monkeypatch):
    llm = make_llm(tiny_llama_dir, spec=True)
    expected = alone(make_llm(tiny_llama_dir, spec=False), greedy=True)

    def propose(decoding):
        raise RuntimeError("injected proposer fault")

    monkeypatch.setattr(llm.engine.proposer, "propose", propose)
    outs = llm.generate(PROMPTS, [params_for(i, True) for i in range(len(PROMPTS))])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_spec_decode_stats().num_draft_tokens == 0
    assert idle(llm)


def test_async_engine_delivers_the_failure_to_its_request_only(llm, monkeypatch):
    expected = alone(llm, greedy=True)
    engine = llm.engine
    async_engine = AsyncLLMEngine.from_engine(llm)
    real_append = engine.output_processor.append

    def append(req, token):
        if req.prompt == PROMPTS[1] and req.num_output_tokens >= 2:
            raise ValueError("injected detokenizer fault")
        return real_append(req, token)

    monkeypatch.setattr(engine.output_processor, "append", append)

    results = stream_all_greedy(async_engine)
    assert isinstance(results[1], RequestFailedError) and "injected detokenizer fault" in str(results[1])
    assert results[0] == expected[0] and results[2] == expected[2]
    assert idle(llm)


def test_async_engine_failed_forward_spares_requests_outside_the_step(tiny_llama_dir, monkeypatch):
    llm = make_llm(tiny_llama_dir, spec=False, max_num_seqs=1)
    engine = llm.engine
    expected = alone(llm, greedy=True)
    real_execute = engine.runner.execute

    def execute(inputs, **kw):
        if any(i.token_ids[:3] == engine.tokenize(PROMPTS[0])[:3] for i in inputs):
            raise RuntimeError("injected device fault")
        return real_execute(inputs, **kw)

    monkeypatch.setattr(engine.runner, "execute", execute)
    async_engine = AsyncLLMEngine(engine)

    results = stream_all_greedy(async_engine)
    assert isinstance(results[0], EngineStepError) and "injected device fault" in str(results[0])
    assert results[1:] == expected[1:]
    assert idle(llm)


def test_the_facade_refuses_an_engine_a_driver_is_stepping(tiny_llama_dir):
    """Two threads stepping one engine would corrupt it: LLM.generate says so instead."""
    llm = make_llm(tiny_llama_dir, spec=False)
    driver = AsyncLLMEngine.from_engine(llm)
    driver.start()
    try:
        with pytest.raises(RuntimeError, match="AsyncLLMEngine"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not llm.engine.requests                   # the refused request was not left queued
    finally:
        driver.shutdown()
    assert len(llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 2
