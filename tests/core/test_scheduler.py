"""Scheduler tests in the vLLM v1 style: a real Scheduler and KVCacheManager,
model outputs faked by hand (no weights, milliseconds).

``fake_step`` mirrors ``LLMEngine.step``: after ``schedule()`` every scheduled
request's ``num_computed_tokens`` advances by its new tokens plus its draft
tokens; a request that ``will_sample`` then loses the rejected drafts again and
gets ``accepted + 1`` tokens appended, with the max_tokens / max_model_len stop.
The fake target is deterministic (``next_token``), so whatever the chunking,
drafts and preemptions, each request must end with exactly the reference output.
"""
from __future__ import annotations

import pytest

from specserve.core.kv_cache_manager import KVCacheManager
from specserve.core.request import Request, RequestStatus
from specserve.core.scheduler import Scheduler, SchedulerOutput
from specserve.sampling_params import SamplingParams

VOCAB = 1000


def next_token(tokens: list[int]) -> int:
    """The fake target's greedy choice after ``tokens``."""
    return (31 * tokens[-1] + 7 * len(tokens) + 3) % VOCAB


def make_request(request_id: str, prompt_len: int, max_tokens: int | None = 16, first: int = 1) -> Request:
    prompt = [(first + 13 * i) % VOCAB for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(request_id, None, prompt, params, seed=None, eos_token_id=None)


def reference_output(req: Request, max_model_len: int) -> list[int]:
    tokens = list(req.prompt_token_ids)
    out: list[int] = []
    while len(out) < req.max_tokens and len(tokens) < max_model_len:
        tokens.append(next_token(tokens))
        out.append(tokens[-1])
    return out


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, k=0):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, num_lookahead_slots=k)


def check_plan(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of one schedule() result, checked before the fake forward."""
    kv = sched.kv_cache
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    for s in out.scheduled:
        r = s.request
        assert r.status is RequestStatus.RUNNING and r in sched.running
        assert s.num_new_tokens >= 1
        assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
        assert s.will_sample == (r.num_computed_tokens + s.num_new_tokens == r.num_tokens)
        # Blocks cover every slot written this step, lookahead slots included.
        need = r.num_computed_tokens + s.num_new_tokens + s.num_lookahead
        assert len(kv.block_table(r.request_id)) * kv.block_size >= need
        if s.num_lookahead:
            assert s.will_sample and s.num_new_tokens == 1      # decoding only, never in prefill
            assert s.num_lookahead <= sched.num_lookahead_slots
            assert r.num_output_tokens + s.num_lookahead + 1 <= r.max_tokens
            assert r.num_tokens + s.num_lookahead + 1 <= sched.max_model_len
    for r in out.preempted:
        assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0
        assert kv.block_table(r.request_id) == []
        assert r.request_id not in ids
    # Only running requests hold blocks, and nothing leaks.
    assert all(kv.block_table(r.request_id) == [] for r in sched.waiting)
    held = [b for r in sched.running for b in kv.block_table(r.request_id)]
    assert len(held) == len(set(held)) == kv.num_used_blocks()


def fake_step(sched: Scheduler, accept=lambda s: s.num_lookahead) -> SchedulerOutput:
    """One engine step with a fake model; ``accept(s)`` = how many drafts are accepted."""
    out = sched.schedule()
    check_plan(sched, out)
    for s in out.scheduled:
        req = s.request
        # The proposer fills every lookahead slot; a draft is correct iff it will be accepted.
        n_acc = accept(s) if s.will_sample else 0
        assert 0 <= n_acc <= s.num_lookahead
        seq = list(req.all_token_ids)
        drafts = []
        for i in range(s.num_lookahead):
            good = next_token(seq)
            drafts.append(good if i < n_acc else (good + 1) % VOCAB)
            seq.append(drafts[-1])
        req.draft_token_ids = drafts
        req.num_computed_tokens += s.num_new_tokens + len(drafts)
        if not s.will_sample:
            req.draft_token_ids = []
            continue
        req.num_computed_tokens -= len(drafts) - n_acc
        emitted = drafts[:n_acc] + [next_token(req.all_token_ids + drafts[:n_acc])]
        req.draft_token_ids = []
        for tok in emitted:
            req.append_token(tok)
            if req.num_output_tokens >= req.max_tokens or req.num_tokens >= sched.max_model_len:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
                break
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, **kw) -> int:
    steps = 0
    while sched.has_unfinished():
        fake_step(sched, **kw)
        steps += 1
        assert steps < max_steps, "the scheduler stopped making progress"
    return steps


# ---------------------------------------------------------------------------- budget


def test_token_budget_respected_and_everything_finishes():
    sched = make_scheduler(max_num_batched_tokens=10, k=3)
    reqs = [make_request(str(i), prompt_len=3 + 5 * i, max_tokens=6, first=i) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        out = fake_step(sched)
        assert 0 < out.num_tokens <= 10
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_output(r, sched.max_model_len)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


# ---------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_samples_only_at_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=128)
    req = make_request("long", prompt_len=50, max_tokens=3)
    sched.add_request(req)
    chunks = []
    while req.num_output_tokens == 0:
        out = fake_step(sched)
        (s,) = out.scheduled
        chunks.append((s.num_new_tokens, s.will_sample))
        if not s.will_sample:
            assert req.num_output_tokens == 0
    assert chunks == [(16, False), (16, False), (16, False), (2, True)]
    assert req.num_computed_tokens == 50 and req.num_tokens == 51
    run_to_completion(sched)
    assert req.output_token_ids == reference_output(req, 128)


def test_chunked_prefill_shares_the_budget_with_decoding_requests():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=128)
    a = make_request("a", prompt_len=4, max_tokens=20)
    sched.add_request(a)
    fake_step(sched)                         # a: prefill, first token
    b = make_request("b", prompt_len=20, max_tokens=2, first=5)
    sched.add_request(b)
    out = fake_step(sched)
    assert [(s.request.request_id, s.num_new_tokens, s.will_sample) for s in out.scheduled] == [
        ("a", 1, True), ("b", 7, False)]
    out = fake_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    out = fake_step(sched)
    assert [(s.request.request_id, s.num_new_tokens, s.will_sample) for s in out.scheduled] == [
        ("a", 1, True), ("b", 6, True)]
    assert b.num_output_tokens == 1
    run_to_completion(sched)
    assert a.output_token_ids == reference_output(a, 128)
    assert b.output_token_ids == reference_output(b, 128)


# ---------------------------------------------------------------------------- batching


def test_new_requests_join_running_ones():
    sched = make_scheduler()
    a = make_request("a", prompt_len=5, max_tokens=10)
    sched.add_request(a)
    fake_step(sched)
    fake_step(sched)
    assert a.num_output_tokens == 2
    b = make_request("b", prompt_len=3, max_tokens=4, first=9)
    sched.add_request(b)
    out = fake_step(sched)
    # Running requests first, then the newcomer, in one batch.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 3)]
    assert a.num_output_tokens == 3 and b.num_output_tokens == 1
    run_to_completion(sched)
    assert a.output_token_ids == reference_output(a, 64)
    assert b.output_token_ids == reference_output(b, 64)


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(str(i), prompt_len=4, max_tokens=3 + i, first=i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out = fake_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["0", "1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    fake_step(sched)
    out = fake_step(sched)                     # "0" finishes here (3 tokens)
    assert reqs[0].is_finished()
    out = fake_step(sched)                     # so "2" joins
    assert [s.request.request_id for s in out.scheduled] == ["1", "2"]
    while sched.has_unfinished():
        fake_step(sched)
        assert len(sched.running) <= 2
    assert all(r.output_token_ids == reference_output(r, 64) for r in reqs)


# ---------------------------------------------------------------------------- lookahead


def test_lookahead_reserved_for_decoding_requests_only():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, k=3)
    req = make_request("a", prompt_len=6, max_tokens=100)
    sched.add_request(req)
    out = fake_step(sched)
    assert out.scheduled[0].num_new_tokens == 6 and out.scheduled[0].num_lookahead == 0  # prefill
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.num_lookahead, s.will_sample) == (1, 3, True)
    # Blocks for num_computed + 1 + k = 6 + 1 + 3 = 10 tokens -> 3 blocks of 4.
    assert len(sched.kv_cache.block_table("a")) == 3
    assert out.num_tokens == 4


def test_no_lookahead_for_prefill_chunks():
    sched = make_scheduler(max_num_batched_tokens=5, max_model_len=128, k=3)
    req = make_request("a", prompt_len=23, max_tokens=5)
    sched.add_request(req)
    while req.num_output_tokens == 0:
        out = fake_step(sched)
        assert out.scheduled[0].num_lookahead == 0
    out = fake_step(sched)
    assert out.scheduled[0].num_lookahead == 3


@pytest.mark.parametrize("max_tokens, expected", [(2, 0), (3, 1), (4, 2), (5, 3), (50, 3)])
def test_lookahead_capped_by_max_tokens(max_tokens, expected):
    sched = make_scheduler(k=3)
    req = make_request("a", prompt_len=4, max_tokens=max_tokens)
    sched.add_request(req)
    fake_step(sched)                        # one output token so far
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead == expected


@pytest.mark.parametrize("prompt_len, expected", [(6, 0), (5, 1), (4, 2), (3, 3), (2, 3)])
def test_lookahead_capped_by_max_model_len(prompt_len, expected):
    sched = make_scheduler(max_model_len=8, k=3)
    req = make_request("a", prompt_len=prompt_len, max_tokens=100)
    sched.add_request(req)
    fake_step(sched)                        # num_tokens = prompt_len + 1
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_lookahead == expected
    # Slots are reserved for at most max_model_len - 1 tokens: the last emitted one needs no KV yet.
    assert req.num_computed_tokens + 1 + s.num_lookahead <= 8 - 1
    assert len(sched.kv_cache.block_table("a")) == 2


def test_lookahead_never_runs_past_the_limits_to_the_end():
    for max_tokens, max_model_len in [(7, 64), (40, 20), (1, 64), (5, 9)]:
        sched = make_scheduler(max_model_len=max_model_len, k=4)
        req = make_request("a", prompt_len=4, max_tokens=max_tokens)
        sched.add_request(req)
        run_to_completion(sched)           # check_plan asserts the caps at every step
        assert req.output_token_ids == reference_output(req, max_model_len)
        assert req.num_output_tokens == min(max_tokens, max_model_len - 4)


def test_lookahead_limited_by_token_budget():
    sched = make_scheduler(max_num_batched_tokens=6, k=4)
    a, b = make_request("a", 2, 50), make_request("b", 2, 50, first=3)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)
    out = sched.schedule()
    assert [(s.num_new_tokens, s.num_lookahead) for s in out.scheduled] == [(1, 4), (1, 0)]


def test_drafts_leave_a_token_for_each_running_request_behind_them():
    """Four decoding requests, k = 3, 8 tokens a step: the first ones' drafts stop short of the
    budget the later ones' own tokens need, so every request runs in every step (a beam search
    needs all its beams in one step)."""
    sched = make_scheduler(max_num_batched_tokens=8, k=3)
    reqs = [make_request(name, 2, 50) for name in "abcd"]
    for r in reqs:
        sched.add_request(r)
    fake_step(sched)
    out = sched.schedule()
    assert [(s.num_new_tokens, s.num_lookahead) for s in out.scheduled] == [(1, 3), (1, 1), (1, 0), (1, 0)]


# ---------------------------------------------------------------------------- rollback


def test_rejection_rolls_back_num_computed_without_freeing_blocks():
    sched = make_scheduler(block_size=4, k=3)
    req = make_request("a", prompt_len=7, max_tokens=100)
    sched.add_request(req)
    fake_step(sched)                                   # prefill: 7 computed, 8 tokens
    table = list(sched.kv_cache.block_table("a"))
    free = sched.kv_cache.num_free_blocks
    fake_step(sched, accept=lambda s: 0)               # 1 + 3 drafts, all rejected
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    table_after = sched.kv_cache.block_table("a")
    assert table_after[: len(table)] == table           # blocks only ever added
    assert len(table_after) == 3                         # 7 + 1 + 3 lookahead slots = 11 -> 3 blocks
    free = sched.kv_cache.num_free_blocks
    fake_step(sched, accept=lambda s: 1)               # 8 + 1 + 3 = 12 slots: same 3 blocks; 1 accepted
    assert req.num_computed_tokens == 10 and req.num_tokens == 11
    assert sched.kv_cache.num_free_blocks == free       # nothing freed, nothing new
    fake_step(sched, accept=lambda s: s.num_lookahead)  # 10 + 1 + 3 = 14 slots -> 4 blocks; all accepted + bonus
    assert req.num_computed_tokens == 14 and req.num_tokens == 15
    assert sched.kv_cache.num_free_blocks == free - 1
    run_to_completion(sched, accept=lambda s: s.num_lookahead // 2)
    assert req.output_token_ids == reference_output(req, 64)


# ---------------------------------------------------------------------------- preemption


def test_preemption_of_the_newest_running_request():
    # 4 blocks of 4 slots; three 4-token prompts take 3 blocks, then each needs a 2nd block.
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b, c = (make_request(n, 4, max_tokens=3, first=i) for i, n in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    fake_step(sched)
    assert sched.kv_cache.num_free_blocks == 1 and c.num_output_tokens == 1
    c_tokens = list(c.all_token_ids)
    out = fake_step(sched)
    # a takes the free block; b needs one too: c (newest) is preempted, not b.
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert out.preempted == [c]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.kv_cache.block_table("c") == []
    assert sched.num_preemptions == 1          # the count the metrics report
    assert sched.waiting[0] is c and c.all_token_ids == c_tokens   # tokens kept, KV dropped
    # c resumes once a and b finish, recomputes prompt + output, and finishes.
    while not c.is_finished():
        out = fake_step(sched)
        if c in [s.request for s in out.scheduled] and c.num_output_tokens == 1:
            pytest.fail("c should have been recomputed in one chunk and sampled")
    assert a.status is b.status is c.status is RequestStatus.FINISHED_LENGTH
    for r in (a, b, c):
        assert r.output_token_ids == reference_output(r, 64)
    assert sched.kv_cache.num_free_blocks == 4


def test_preemption_of_the_request_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3, block_size=4)
    a, b = make_request("a", 4, max_tokens=5), make_request("b", 4, max_tokens=5, first=2)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)                     # 2 blocks used, 1 free
    out = fake_step(sched)               # a takes it, b cannot grow and is preempted
    assert [s.request for s in out.scheduled] == [a] and out.preempted == [b]
    b_len = b.num_tokens                 # prompt + its 1 output token
    resumed = False
    while sched.has_unfinished():
        out = fake_step(sched)
        for s in out.scheduled:
            if s.request is b and s.num_new_tokens == b_len:
                resumed = True         # recomputed from scratch in one chunk
    assert resumed
    assert a.output_token_ids == reference_output(a, 64)
    assert b.output_token_ids == reference_output(b, 64)
    assert sched.kv_cache.num_free_blocks == 3


def test_preemption_with_lookahead_slots():
    sched = make_scheduler(num_blocks=6, block_size=4, k=3, max_model_len=20)
    reqs = [make_request(str(i), 4, max_tokens=12, first=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, accept=lambda s: s.num_lookahead - 1 if s.num_lookahead else 0)
    assert sched.num_preemptions == sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert r.output_token_ids == reference_output(r, 20)
    assert sched.kv_cache.num_free_blocks == 6


# ---------------------------------------------------------------------------- priorities


def prioritized(request_id: str, priority: int, **kw) -> Request:
    req = make_request(request_id, 4, first=len(request_id) + ord(request_id[0]), **kw)
    req.priority = priority
    return req


def test_waiting_requests_queue_by_priority_then_arrival():
    sched = make_scheduler()
    for name, p in [("a", 1), ("b", 0), ("c", 1), ("d", -2), ("e", 0)]:
        sched.add_request(prioritized(name, p))
    assert [r.request_id for r in sched.waiting] == ["d", "b", "e", "a", "c"]
    f = prioritized("f", 0)
    sched._queue(f, front=True)     # a preempted request goes back to the front of its priority's run
    assert [r.request_id for r in sched.waiting] == ["d", "f", "b", "e", "a", "c"]


def test_with_one_seat_the_higher_priority_runs_first():
    sched = make_scheduler(max_num_seqs=1)
    low, high = prioritized("low", 5, max_tokens=2), prioritized("high", 0, max_tokens=2)
    sched.add_request(low)
    sched.add_request(high)
    order = []
    while sched.has_unfinished():
        order += [s.request.request_id for s in fake_step(sched).scheduled if s.request.request_id not in order]
    assert order == ["high", "low"]
    assert low.output_token_ids == reference_output(low, 64) and high.output_token_ids == reference_output(high, 64)


def test_a_full_cache_preempts_the_lowest_priority_not_the_newest():
    # 4 blocks of 4 slots: the low-priority request runs first, the others join it, then b needs a
    # second block: under FCFS the newest (c) would go; here the lowest priority (a) goes.
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b, c = prioritized("a", 3, max_tokens=6), prioritized("bb", 0, max_tokens=3), prioritized("ccc", 0, max_tokens=3)
    sched.add_request(a)
    fake_step(sched)
    sched.add_request(b)
    sched.add_request(c)
    fake_step(sched)                      # a grows into its 2nd block; b and c take one each
    assert sched.kv_cache.num_free_blocks == 0
    out = fake_step(sched)
    assert out.preempted == [a] and a.status is RequestStatus.WAITING
    assert [s.request for s in out.scheduled] == [b, c]
    run_to_completion(sched)
    for r in (a, b, c):
        assert r.output_token_ids == reference_output(r, 64)
    assert sched.kv_cache.num_free_blocks == 4


# ---------------------------------------------------------------------------- finish / abort


def test_finish_and_abort_free_blocks():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    a = make_request("a", 6, max_tokens=50)
    b = make_request("b", 20, max_tokens=50)      # will be mid-prefill
    c = make_request("c", 4, max_tokens=50)       # never scheduled
    for r in (a, b, c):
        sched.add_request(r)
    fake_step(sched)
    assert sched.kv_cache.block_table("a") and sched.kv_cache.block_table("b")
    assert 0 < b.num_computed_tokens < b.num_prompt_tokens
    used_by_b = len(sched.kv_cache.block_table("b"))
    free = sched.kv_cache.num_free_blocks
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert b.status is RequestStatus.FINISHED_ABORTED and b not in sched.running
    assert sched.kv_cache.num_free_blocks == free + used_by_b
    sched.finish(c, RequestStatus.FINISHED_ABORTED)         # waiting: just dropped
    assert c not in sched.waiting
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    assert sched.kv_cache.num_free_blocks == 16
    assert not sched.has_unfinished()
    assert sched.schedule().scheduled == []


def test_max_loras_lets_requests_behind_a_third_adapter_go_first_and_keeps_its_place():
    """At most max_loras adapters run at once: a request of another waits (in its place in the
    queue) while requests of running adapters, or of none, behind it are admitted."""
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, 8, 64, 64, max_loras=2)
    reqs = [make_request(f"r{i}", 3, first=i) for i in range(6)]
    for req, lora in zip(reqs, [1, 2, 3, 0, 1, 3]):
        req.lora_id = lora
        sched.add_request(req)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r5"]
    for r in (reqs[1],):                       # adapter 2's only request finishes: adapter 3 may come in
        sched.finish(r, RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert {s.request.request_id for s in out.scheduled} >= {"r2", "r5"} and not sched.waiting
    unlimited = Scheduler(KVCacheManager(64, 4), 8, 64, 64)
    for i, lora in enumerate([1, 2, 3]):
        r = make_request(f"u{i}", 3)
        r.lora_id = lora
        unlimited.add_request(r)
    assert len(unlimited.schedule().scheduled) == 3
