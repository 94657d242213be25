"""Continuous batching under a per-step token budget, with lookahead slots.

There is no prefill phase and no decode phase: each step, every request is
given ``num_tokens - num_computed_tokens`` new tokens (capped by the budget, so
long prompts are chunked) and, when it is decoding and speculation is on, up
to k lookahead slots for draft tokens (as many as the budget leaves after one token for each
running request behind it). Running requests go first; waiting ones
join while budget and blocks last, each starting after the longest prefix of
its tokens the KV cache already holds (prefix caching). When blocks run out, the most recently
admitted running request is preempted: its blocks are freed and it is
recomputed later from its tokens (same output, since nothing is lost).

Priorities (vLLM's ``scheduling_policy="priority"``; every request 0 under FCFS): a request's
``priority`` (lower first) orders both lists. Waiting requests queue by priority, and in arrival
order within one; running ones are served in priority order, so the one preempted when blocks
run out is the lowest-priority one admitted last. With equal priorities this is FCFS exactly.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.core.kv_cache_manager import KVCacheManager
from specserve.core.request import Request, RequestStatus


def _priority(req: Request) -> int:
    return req.priority


# Prefill tokens a step computes for a request collecting prompt logprobs: each brings a
# [vocabulary] row of logits (engine/prompt_logprobs.py), 512 x 151,936 float32 = 311 MB at most.
MAX_PROMPT_LOGPROB_CHUNK = 512


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int      # tokens of the request itself (prefill chunk or the last sampled token)
    num_lookahead: int       # draft tokens it may carry this step (0 = none)
    will_sample: bool = False  # this step reaches the request's last token, so it emits tokens

    def __post_init__(self) -> None:
        r = self.request
        self.will_sample = r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_lookahead_slots: int = 0,
        max_loras: int | None = None,
    ):
        """``max_loras``: the most LoRA adapters the running requests may use at once (None: no limit)."""
        self.kv_cache = kv_cache
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_lookahead_slots = num_lookahead_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0          # running requests sent back to wait, since start-up (metrics)

    def add_request(self, request: Request) -> None:
        """Queue ``request`` behind every waiting request of its priority or a higher one."""
        self._queue(request, front=False)

    def _queue(self, req: Request, front: bool) -> None:
        """Into the waiting queue at the front or the back of its priority's run of requests."""
        waiting, p = self.waiting, req.priority
        if not front and (not waiting or waiting[-1].priority <= p):
            waiting.append(req)
        elif front and (not waiting or waiting[0].priority >= p):
            waiting.appendleft(req)
        else:
            at = next(j for j, w in enumerate(waiting) if (w.priority >= p if front else w.priority > p))
            waiting.insert(at, req)

    def add_running(self, request: Request) -> None:
        """A request that already holds its KV blocks (a beam forked from another) runs from the
        next step, without waiting for admission."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _lookahead_for(self, request: Request, num_new: int, budget_left: int) -> int:
        """Draft slots for a decoding request, never past max_tokens or max_model_len."""
        if self.num_lookahead_slots == 0 or num_new != 1:
            return 0
        room_output = request.max_tokens - request.num_output_tokens - 1
        room_context = self.max_model_len - request.num_tokens - 1
        return max(0, min(self.num_lookahead_slots, room_output, room_context, budget_left))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        # 1. Running requests, oldest first (by priority first: a stable sort); preempt from the
        # newest (of the lowest priority) when out of blocks.
        self.running.sort(key=_priority)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_cap(req))
            # Drafts never take the token a later running request needs for its own step: a beam
            # search runs only in a step that holds all its beams, so a budget spent on the first
            # beams' drafts would hold the search back for good.
            later = len(self.running) - i - 1
            lookahead = self._lookahead_for(req, num_new, budget - num_new - later)
            needed = req.num_computed_tokens + num_new + lookahead
            while not self.kv_cache.allocate_slots(req.request_id, needed):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # req itself was preempted; self.running shrank
            out.scheduled.append(ScheduledRequest(req, num_new, lookahead))
            scheduled_ids.add(req.request_id)
            budget -= num_new + lookahead
            i += 1

        # 2. Waiting requests (new or preempted), in priority then arrival order; one whose LoRA
        # adapter would be one more than max_loras lets those behind it go first.
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if not self._lora_fits(req):
                skipped.append(self.waiting.popleft())
                continue
            looked_up = req.num_computed_tokens == 0
            # new or preempted: start after its longest cached prefix, unless every prompt position
            # must be computed for its prompt logprobs
            if looked_up and not req.needs_prompt_logprobs:
                req.num_computed_tokens = self.kv_cache.acquire_cached_prefix(req.request_id, req.all_token_ids,
                                                                            req.cache_root)
                req.num_cached_tokens = req.num_computed_tokens
                # the proposer's K/V that came with the blocks (core/kv_cache_manager.py's proposer_kv)
                req.proposer_num_computed_tokens = self.kv_cache.proposer_tokens_in_hit(req.request_id,
                                                                                         req.num_computed_tokens)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_cap(req))
            lookahead = self._lookahead_for(req, num_new, budget - num_new)
            if not self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + num_new + lookahead):
                self.kv_cache.free(req.request_id)   # the cached prefix too: taken again next time
                req.num_computed_tokens = req.proposer_num_computed_tokens = 0
                break
            if looked_up:
                self.kv_cache.record_lookup(req.num_tokens, req.num_cached_tokens)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, lookahead))
            budget -= num_new + lookahead
        self.waiting.extendleft(reversed(skipped))
        return out

    def _lora_fits(self, req: Request) -> bool:
        """Whether ``req`` may run beside the running requests: no adapter, or one already running,
        or fewer than max_loras adapters running."""
        if not req.lora_id or self.max_loras is None:
            return True
        running = {r.lora_id for r in self.running} - {0}
        return req.lora_id in running or len(running) < self.max_loras

    @staticmethod
    def _chunk_cap(req: Request) -> int:
        """The most tokens a step computes for ``req``: MAX_PROMPT_LOGPROB_CHUNK while it collects
        prompt logprobs (each such token brings a row of logits), else no limit of its own."""
        return MAX_PROMPT_LOGPROB_CHUNK if req.needs_prompt_logprobs else req.num_tokens

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.requeue(req, front=True)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def requeue(self, req: Request, front: bool) -> None:
        """Put a request back in the waiting queue, at the front or the back of its priority's
        requests (all of them, under FCFS). A running one is
        preempted: it gives its blocks up and is computed again from its tokens when admitted."""
        if req in self.running:
            self.running.remove(req)
            self.kv_cache.free(req.request_id)
            req.status = RequestStatus.WAITING
            req.discard_kv()
            req.num_preemptions += 1
            self.num_preemptions += 1
        else:
            self.waiting.remove(req)
        self._queue(req, front)

    def finish(self, req: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """Mark a request finished (stop, length or abort) and free its blocks (``free_blocks``
        False: the caller frees them later, ``KVCacheManager.free``)."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if free_blocks:
            self.kv_cache.free(req.request_id)
