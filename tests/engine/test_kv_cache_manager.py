"""KVCacheManager: all-or-nothing allocation, freeing, and a randomized run of
1,000 requests through the scheduler on a block pool small enough to force
preemption (no weights; the model is faked as in test_scheduler.py)."""
from __future__ import annotations

import random

import pytest

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request, RequestStatus
from specserve.engine.scheduler import Scheduler
from specserve.sampling_params import SamplingParams


def test_blocks_for():
    kv = KVCacheManager(8, 4)
    assert [kv.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_no_blocks_is_an_error():
    with pytest.raises(ValueError, match="kv_cache_memory"):
        KVCacheManager(0, 16)


def test_allocate_grows_a_table_and_never_shrinks_it():
    kv = KVCacheManager(8, 4)
    assert kv.allocate_slots("a", 10)
    table = list(kv.block_table("a"))
    assert len(table) == 3 and kv.num_free_blocks == 5 and kv.num_used_blocks() == 3
    assert kv.allocate_slots("a", 12)               # still 3 blocks
    assert kv.block_table("a") == table
    assert kv.allocate_slots("a", 5)                # fewer tokens: nothing is freed
    assert kv.block_table("a") == table
    assert kv.allocate_slots("a", 13)
    assert kv.block_table("a")[:3] == table and len(kv.block_table("a")) == 4
    assert kv.allocate_slots("b", 16)
    assert len(set(kv.block_table("a")) | set(kv.block_table("b"))) == 8   # distinct blocks
    assert kv.num_free_blocks == 0


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(4, 4)
    assert kv.allocate_slots("a", 4)
    # A new request that does not fit gets nothing and leaves no table behind.
    assert not kv.allocate_slots("b", 17)
    assert kv.block_table("b") == [] and "b" not in kv._tables
    assert kv.num_free_blocks == 3
    # A growing request that does not fit keeps exactly what it had.
    assert not kv.allocate_slots("a", 4 * 5)
    assert len(kv.block_table("a")) == 1 and kv.num_free_blocks == 3
    assert kv.allocate_slots("a", 16)               # exactly fits
    assert kv.num_free_blocks == 0
    assert not kv.allocate_slots("c", 1)
    assert kv.allocate_slots("c", 0)                # zero tokens need zero blocks


def test_free():
    kv = KVCacheManager(6, 2)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 6)
    kv.free("a")
    assert kv.block_table("a") == [] and kv.num_free_blocks == 3
    kv.free("a")                                    # freeing twice or an unknown id is a no-op
    kv.free("nope")
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots("c", 6)                # the freed blocks are reused
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 6
    assert sorted(kv._free) == list(range(6))


# --------------------------------------------------------------------------- randomized


VOCAB = 997


def _next_token(tokens: list[int]) -> int:
    return (17 * tokens[-1] + 5 * len(tokens) + 1) % VOCAB


def _reference(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens and len(tokens) < max_model_len:
        tokens.append(_next_token(tokens))
        out.append(tokens[-1])
    return out


def test_random_requests_with_aborts_and_preemption_free_every_block():
    rng = random.Random(1234)
    block_size, max_model_len, k = 4, 48, 3
    # The engine requires one max-length request (+ lookahead) to fit: 13 blocks. 20 forces preemption.
    num_blocks = 20
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(kv, max_num_seqs=12, max_num_batched_tokens=40, max_model_len=max_model_len, num_lookahead_slots=k)

    pending = []
    for i in range(1000):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_model_len - 1))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24))
        pending.append(Request(str(i), None, prompt, params, generator=None, eos_token_id=None))
    all_requests = list(pending)
    pending.reverse()
    live: list[Request] = []
    aborted: set[str] = set()
    steps = 0
    while pending or sched.has_unfinished():
        steps += 1
        assert steps < 20_000, "no progress"
        for _ in range(rng.randint(0, 3)):               # arrivals
            if pending:
                r = pending.pop()
                sched.add_request(r)
                live.append(r)
        if live and rng.random() < 0.08:                 # aborts: waiting, running or preempted
            victim = live.pop(rng.randrange(len(live)))
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim.request_id)
        out = sched.schedule()
        assert out.num_tokens <= sched.max_num_batched_tokens
        for s in out.scheduled:
            req = s.request
            slots = req.num_computed_tokens + s.num_new_tokens + s.num_lookahead
            assert len(kv.block_table(req.request_id)) * block_size >= slots
            assert req.num_tokens + s.num_lookahead <= max_model_len - 1 or s.num_lookahead == 0
            n_acc = rng.randint(0, s.num_lookahead)
            req.num_computed_tokens += s.num_new_tokens + s.num_lookahead
            if not s.will_sample:
                continue
            req.num_computed_tokens -= s.num_lookahead - n_acc
            for _ in range(n_acc + 1):                  # accepted drafts are the target's tokens
                req.append_token(_next_token(req.all_token_ids))
                if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    live.remove(req)
                    break
        held = [b for r in sched.running for b in kv.block_table(r.request_id)]
        assert len(held) == len(set(held)) == kv.num_used_blocks()
        assert all(kv.block_table(r.request_id) == [] for r in sched.waiting)

    assert kv.num_free_blocks == num_blocks
    assert not sched.running and not sched.waiting and not live
    assert sum(r.num_preemptions for r in all_requests) > 20      # the pool was small enough to matter
    assert 50 < len(aborted) < 500
    for r in all_requests:
        if r.request_id in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH, r
            assert r.output_token_ids == _reference(r.prompt_token_ids, r.max_tokens, max_model_len)
