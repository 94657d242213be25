"""Priority scheduling (vLLM's scheduling_policy="priority") through the engine and ``LLM``:
a higher-priority request overtakes queued ones, outputs are what each request gives alone,
and an engine serving first come, first served refuses priorities. Tiny random model."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.engine.input_checks import check_priority

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[300 + 7 * i + j for j in range(12)] for i in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               scheduling_policy="priority", max_num_seqs=1)


def finish_order(engine, priorities) -> list[str]:
    ids = [engine.add_request(p, PARAMS, priority=prio) for p, prio in zip(PROMPTS, priorities)]
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return [ids.index(r) for r in order]


def test_one_seat_serves_by_priority_then_arrival(llm):
    assert finish_order(llm.engine, [2, 0, 1, 0]) == [1, 3, 2, 0]


def test_outputs_do_not_depend_on_priority(llm, tiny_llama_dir):
    alone = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    want = [o.outputs[0].token_ids for o in alone.generate(PROMPTS, PARAMS, use_tqdm=False)]
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[3, -1, 0, 2])
    assert [o.outputs[0].token_ids for o in got] == want           # in input order, as without priorities


def test_first_come_first_served_refuses_priorities(tiny_llama_dir, llm):
    fcfs = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    with pytest.raises(ValueError, match="needs the priority scheduling policy"):
        fcfs.generate(PROMPTS[:2], PARAMS, use_tqdm=False, priority=[0, 1])
    assert not fcfs.engine.has_unfinished_requests()                 # nothing queued
    assert fcfs.generate(PROMPTS[:1], PARAMS, use_tqdm=False, priority=[0])[0].finished
    with pytest.raises(ValueError, match="2 priorities"):
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False, priority=[0, 1])
    for bad in (1.5, True, 1 << 40):
        with pytest.raises(ValueError, match="priority must be an integer"):
            check_priority(bad, "priority")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(model=tiny_llama_dir, dtype="float32", scheduling_policy="lifo")


def test_priorities_under_preemption_and_speculation_keep_every_output(tiny_llama_dir):
    """A cache too small for the batch: the lowest priorities are preempted and recomputed, and every
    greedy answer is still what it is alone (n-gram drafts on)."""
    prompts = [[300 + 7 * i + j for j in range(40)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, params, use_tqdm=False)]
    small = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, scheduling_policy="priority",
                kv_cache_memory=22 * 16 * alone.engine.runner.bytes_per_block // 16,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = small.engine
    ids = [engine.add_request(p, params, priority=prio) for p, prio in zip(prompts, [3, 0, 2, 1, 0, 3])]
    preempted, got = {}, {}
    while engine.has_unfinished_requests():
        for r in engine.scheduler.running + list(engine.scheduler.waiting):
            preempted[r.request_id] = r.num_preemptions
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    assert [got[i] for i in ids] == want
    assert sum(preempted.values()) > 0
    assert preempted[ids[1]] == preempted[ids[4]] == 0       # priority 0 is never the one preempted
