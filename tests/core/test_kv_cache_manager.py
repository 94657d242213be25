"""KVCacheManager: all-or-nothing allocation, freeing, and a randomized run of
1,000 requests through the scheduler on a block pool small enough to force
preemption (no weights; the model is faked as in test_scheduler.py)."""
from __future__ import annotations

import random

import pytest

from specserve.core.kv_cache_manager import PROPOSER_KV_FROM_FEATURES, PROPOSER_KV_FROM_TOKENS, KVCacheManager
from specserve.core.request import Request, RequestStatus
from specserve.core.scheduler import Scheduler
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
        pending.append(Request(str(i), None, prompt, params, seed=None, eos_token_id=None))
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


# ------------------------------------------------------------ prefix caching
def cached(num_blocks: int = 8, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)


def run_request(kv: KVCacheManager, rid: str, tokens: list[int], verified: int | None = None,
                proposer: int | None = None) -> int:
    """Admit a request (cached prefix first), allocate the rest, register its verified blocks
    (and mark those where the proposer's K/V is final, below ``proposer``)."""
    hit = kv.acquire_cached_prefix(rid, tokens)
    assert kv.allocate_slots(rid, len(tokens))
    kv.record_lookup(len(tokens), hit)
    kv.cache_full_blocks(rid, tokens, len(tokens) if verified is None else verified, proposer)
    return hit


def test_a_second_request_reuses_the_full_blocks_of_a_shared_prefix():
    kv = cached()
    a = list(range(10))                        # blocks [0-3] [4-7] and a partial [8, 9]
    assert run_request(kv, "a", a) == 0
    b = a[:8] + [50, 51, 52]
    assert run_request(kv, "b", b) == 8        # both full blocks, not the partial one
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (21, 8)


def test_a_block_is_shared_only_after_the_same_prefix():
    kv = cached()
    run_request(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # The same second block after a different first block is a different prefix.
    assert run_request(kv, "b", [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0


def test_at_least_one_token_is_left_to_compute():
    kv = cached()
    run_request(kv, "a", list(range(8)))
    kv.free("a")
    assert kv.acquire_cached_prefix("b", list(range(8))) == 4   # 8 cached, but the last token needs logits


def test_unverified_tokens_are_never_registered():
    kv = cached()
    tokens = list(range(12))
    run_request(kv, "a", tokens, verified=7)   # positions 7..11 hold draft tokens awaiting verification
    registered = [kv.cached_block_key(b) is not None for b in kv.block_table("a")]
    assert registered == [True, False, False]
    kv.cache_full_blocks("a", tokens, 12)        # verified later: now they count
    assert [kv.cached_block_key(b) is not None for b in kv.block_table("a")] == [True, True, True]


def test_released_blocks_stay_cached_until_the_pool_needs_them_least_recently_used_first():
    kv = cached(num_blocks=4, block_size=2)
    run_request(kv, "a", [1, 2, 3])            # block [1 2] + partial
    run_request(kv, "b", [5, 6, 7])            # block [5 6] + partial
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 4 and kv.num_used_blocks() == 0
    # The two unregistered partial blocks go first; [1 2] (released before [5 6]) next.
    assert kv.allocate_slots("c", 6)           # 3 blocks: both partials and [1 2]
    assert kv.acquire_cached_prefix("d", [1, 2, 3]) == 0
    assert kv.acquire_cached_prefix("e", [5, 6, 7]) == 2


def test_shared_blocks_are_reference_counted():
    kv = cached(num_blocks=4, block_size=2)
    run_request(kv, "a", [1, 2, 3])
    run_request(kv, "b", [1, 2, 4])
    shared = kv.block_table("a")[0]
    kv.free("a")
    assert shared not in kv._free                # still used by b
    assert kv.num_used_blocks() == 2
    kv.free("b")
    assert kv.num_used_blocks() == 0


def test_an_eagle_heads_kv_is_marked_when_final_and_a_hit_copies_the_block_whose_next_token_differs():
    """proposer_kv "from_features" (EAGLE's head K/V in the same blocks): registration does not
    wait for the head, but a block is marked once the head has computed it, with the token after
    it; a hit ends before the first unmarked block or at the first whose next token differs from
    the request's, copying that one but its last position, which the request computes again."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, proposer_kv=PROPOSER_KV_FROM_FEATURES)
    tokens = list(range(14))                               # 3 full blocks and a partial one
    assert kv.acquire_cached_prefix("a", tokens) == 0 and kv.allocate_slots("a", 14)
    kv.cache_full_blocks("a", tokens, 14, num_proposer_tokens=0)
    a = kv.block_table("a")
    assert [kv.cached_block_key(b) is not None for b in a] == [True, True, True, False]
    assert kv.acquire_cached_prefix("x", tokens) == 0                  # nothing marked: no hit
    kv.free("x")
    kv.cache_full_blocks("a", tokens, 14, num_proposer_tokens=9)
    assert kv._proposer_marks == {a[0]: 4, a[1]: 8}
    assert kv.acquire_cached_prefix("y", tokens) == 8 and kv.proposer_tokens_in_hit("y", 8) == 8
    kv.free("y")
    kv.cache_full_blocks("a", tokens, 14, num_proposer_tokens=13)
    assert kv._proposer_marks == {a[0]: 4, a[1]: 8, a[2]: 12}
    with pytest.raises(ValueError, match="proposer"):
        kv.cache_full_blocks("a", tokens, 14)
    kv.free("a")
    # 3 blocks match; the third's next token differs: copied but for its last slot, computed again.
    assert kv.acquire_cached_prefix("b", tokens[:12] + [99, 98]) == 11 and kv.proposer_tokens_in_hit("b", 11) == 11
    b = kv.block_table("b")
    assert b[:2] == a[:2] and b[2] != a[2]
    assert a[2] not in kv._free                            # the copy's source is kept until copied
    assert kv.take_pending_copies() == ([a[2] * 4 + j for j in range(3)], [b[2] * 4 + j for j in range(3)])
    assert a[2] in kv._free and kv.take_pending_copies() == ([], [])
    assert kv.cached_block_key(a[2]) is not None           # still registered, for the next request
    # The same next tokens all along: every matched block is shared as it is.
    assert kv.acquire_cached_prefix("d", tokens[:13]) == 12
    assert kv.block_table("d") == a[:3] and kv.take_pending_copies() == ([], [])
    # A request freed before its copy is taken leaves nothing to copy and holds nothing.
    assert kv.acquire_cached_prefix("c", tokens[:4] + [77]) == 3
    kv.free("c")
    assert kv.take_pending_copies() == ([], []) and kv.num_used_blocks() == 4   # b's 3 and d's 3, 2 shared


def test_a_block_with_the_proposers_kv_takes_over_the_key_of_one_without():
    """A request whose head never ran (aborted, say) leaves blocks registered but unmarked; an EAGLE
    hit stops before them, so a later request computes its own, which take the keys over once
    marked, and the next request finds them."""
    kv = KVCacheManager(12, 4, enable_prefix_caching=True, proposer_kv=PROPOSER_KV_FROM_FEATURES)
    tokens = list(range(10))
    run_request(kv, "a", tokens, proposer=0)
    a = kv.block_table("a")
    kv.free("a")
    assert run_request(kv, "b", tokens, proposer=10) == 0
    b = kv.block_table("b")
    assert [kv.cached_block_key(x) is not None for x in a[:2] + b[:2]] == [False, False, True, True]
    assert run_request(kv, "c", tokens, proposer=0) == 8 and kv.block_table("c")[:2] == b[:2]


def test_with_no_block_free_for_the_copy_a_hit_ends_a_block_earlier():
    kv = KVCacheManager(3, 4, enable_prefix_caching=True, proposer_kv=PROPOSER_KV_FROM_FEATURES)
    tokens = list(range(12))
    run_request(kv, "a", tokens, proposer=12)
    a = kv.block_table("a")
    assert len(kv._proposer_marks) == 2                    # block 3: its next token is not known yet
    assert kv.acquire_cached_prefix("b", tokens[:8] + [50, 51]) == 4   # no free block to copy the 2nd into
    assert kv.block_table("b") == a[:1] and kv.take_pending_copies() == ([], [])
    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks() == 0


def test_a_draft_models_kv_is_skipped_where_marked_and_computed_again_after():
    """proposer_kv "from_tokens" (a draft model): a hit takes every matched block; the draft
    starts after the leading blocks where an earlier request's draft computed its K/V."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, proposer_kv=PROPOSER_KV_FROM_TOKENS)
    tokens = list(range(14))
    run_request(kv, "a", tokens, proposer=6)
    a = kv.block_table("a")
    assert kv._proposer_marks == {a[0]: None}
    assert kv.acquire_cached_prefix("b", tokens) == 12 and kv.proposer_tokens_in_hit("b", 12) == 4
    assert kv.take_pending_copies() == ([], [])
    kv.cache_full_blocks("b", tokens, 13, num_proposer_tokens=13)   # b's draft computed the rest
    assert kv.acquire_cached_prefix("c", tokens) == 12 and kv.proposer_tokens_in_hit("c", 12) == 12
    with pytest.raises(ValueError, match="unknown proposer_kv"):
        KVCacheManager(8, 4, proposer_kv="sometimes")
    assert KVCacheManager(8, 4, proposer_kv=PROPOSER_KV_FROM_TOKENS).proposer_kv is None   # caching off


def test_off_means_no_lookups():
    kv = KVCacheManager(8, 4)
    run_request(kv, "a", list(range(9)))
    assert run_request(kv, "b", list(range(9))) == 0
    assert kv.num_queried_tokens == 0


@pytest.mark.parametrize("proposer_kv", [None, PROPOSER_KV_FROM_TOKENS, PROPOSER_KV_FROM_FEATURES])
def test_random_requests_with_prefix_caching_read_back_their_own_tokens(proposer_kv):
    """A simulated KV cache (slot -> token written there) under prefix caching, drafts,
    rejections, aborts and preemption: every position a request has computed reads back
    that request's own token, whether it wrote it or found it cached. With ``proposer_kv`` a
    simulated proposer writes its own K/V in the same slots, (token,) for a draft model and
    (token, next token) for an EAGLE head, computed when it catches up (every other step) and
    guessed at draft positions; every position it has computed reads back the request's own
    value, whether it wrote it or found it cached, through the hits' copies too."""
    rng = random.Random(99)
    block_size, max_model_len, k = 4, 48, 3
    kv = KVCacheManager(14, block_size, enable_prefix_caching=True, proposer_kv=proposer_kv)   # 13 fit one
    width = 2 if proposer_kv == PROPOSER_KV_FROM_FEATURES else 1   # what the proposer's K/V at a position reads
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=40, max_model_len=max_model_len, num_lookahead_slots=k)
    bases = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(3)]
    slots: dict[tuple[int, int], int] = {}
    head: dict[tuple[int, int], tuple] = {}     # the proposer's K/V: (token,) or (token, the token after it)

    def copy_pending() -> None:
        src, dst = kv.take_pending_copies()
        for cache in (slots, head):
            values = [cache.get(divmod(s, block_size)) for s in src]
            for d, v in zip(dst, values):
                cache[divmod(d, block_size)] = v

    def check_registered(req: Request) -> None:
        """A registered block holds exactly the tokens it is registered under: no draft token."""
        for b in kv.block_table(req.request_id):
            key = kv.cached_block_key(b)
            if key is not None:
                assert [slots.get((b, j)) for j in range(block_size)] == list(key[1]), (req, b)
            if b in kv._proposer_marks:   # the proposer's K/V there is the block's own (and its next token's)
                assert [head.get((b, j), (None,))[0] for j in range(block_size)] == list(key[1]), (req, b)
                if width == 2:
                    assert head[(b, block_size - 1)][1] == kv._proposer_marks[b]

    def write(req: Request, start: int, tokens: list[int]) -> None:
        table = kv.block_table(req.request_id)
        for pos, tok in enumerate(tokens, start):
            slots[(table[pos // block_size], pos % block_size)] = tok

    def head_catch_up(req: Request) -> None:
        """Half the time (a step that drafts, or a prefill): the head computes every position
        whose next token is known and the target has computed."""
        end = min(req.num_computed_tokens, req.num_tokens - 1)
        if proposer_kv and rng.random() < 0.5 and end > req.proposer_num_computed_tokens:
            table = kv.block_table(req.request_id)
            for pos in range(req.proposer_num_computed_tokens, end):
                head[(table[pos // block_size], pos % block_size)] = tuple(req.all_token_ids[pos : pos + width])
            req.proposer_num_computed_tokens = end

    pending = []
    for i in range(300):
        base = bases[rng.randrange(3)]
        # Many exact repeats (outputs are deterministic, so those share output blocks too).
        prompt = base[: rng.choice([3, 8, 13, 20])] + [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 5]))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 16))
        pending.append(Request(str(i), None, prompt, params, seed=None, eos_token_id=None))
    pending.reverse()
    live: list[Request] = []
    steps = 0
    while pending or sched.has_unfinished():
        steps += 1
        assert steps < 20_000, "no progress"
        if pending and rng.random() < 0.5:
            r = pending.pop()
            sched.add_request(r)
            live.append(r)
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
        scheduled = sched.schedule().scheduled
        copy_pending()
        for s in scheduled:
            req = s.request
            table = kv.block_table(req.request_id)
            start = req.num_computed_tokens
            for pos in range(start):   # cached or computed earlier: must be this request's tokens
                assert slots.get((table[pos // block_size], pos % block_size)) == req.all_token_ids[pos], (req, pos)
            for pos in range(req.proposer_num_computed_tokens if proposer_kv else 0):
                want = tuple(req.all_token_ids[pos : pos + width])
                assert head.get((table[pos // block_size], pos % block_size)) == want, (req, pos)
            new = req.all_token_ids[start : start + s.num_new_tokens]
            n_acc = rng.randint(0, s.num_lookahead)
            right = list(req.all_token_ids)
            for _ in range(s.num_lookahead):
                right.append(_next_token(right))
            drafts = right[req.num_tokens : req.num_tokens + n_acc]
            drafts += [(t + 1) % VOCAB for t in right[req.num_tokens + n_acc : req.num_tokens + s.num_lookahead]]
            write(req, start, new + drafts)
            for pos in range(req.num_tokens, req.num_tokens + s.num_lookahead):   # the head's guesses
                head[(table[pos // block_size], pos % block_size)] = ("guessed",)
            req.num_computed_tokens += s.num_new_tokens + s.num_lookahead
            if not s.will_sample:
                head_catch_up(req)
                kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens,
                                     req.proposer_num_computed_tokens)
                check_registered(req)
                continue
            req.num_computed_tokens -= s.num_lookahead - n_acc
            finished = False
            for _ in range(n_acc + 1):
                req.append_token(_next_token(req.all_token_ids))
                if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
                    finished = True
                    break
            head_catch_up(req)
            kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens,
                                 req.proposer_num_computed_tokens)
            check_registered(req)
            if finished:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
                live.remove(req)
        held = {b for r in sched.running for b in kv.block_table(r.request_id)}
        assert len(held) == kv.num_used_blocks()
    assert kv.num_used_blocks() == 0
    assert kv.num_hit_tokens > 1000        # the shared prefixes were found


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("proposer_kv,shared_tokens", [(None, 8), (PROPOSER_KV_FROM_TOKENS, 8),
                                                       (PROPOSER_KV_FROM_FEATURES, 4)])
def test_a_fork_shares_the_full_blocks_whose_kv_is_the_same_for_both(proposer_kv, shared_tokens, caching):
    """Beams parting at position 8 (block size 4): the target's and a draft model's K/V below 8 is
    the same for both, so both full blocks are shared; an EAGLE head's K/V at position 7 reads
    token 8, so the second block is the parent's alone."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=caching)
    kv.set_proposer_kv(proposer_kv)
    assert kv.allocate_slots("parent", 10)
    assert kv.fork("parent", "child", 8) == shared_tokens
    assert kv.block_table("child") == kv.block_table("parent")[: shared_tokens // 4]
    kv.free("parent")
    kv.free("child")
    assert kv.num_free_blocks == 8
