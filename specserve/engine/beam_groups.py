"""Beam search requests in the engine (``LLMEngine.add_beam_search``).

Each running beam is an ordinary greedy ``Request`` (``{id}#beam{n}``) that the scheduler runs
like any decoding request: its last token and, with speculation, its draft tokens are
verified in the step's one forward, beside every other request's. The group's search
(``engine.beam_search``) waits until a step holds the logits of ALL its running beams (a step
that scheduled only some of them, under a tight token budget or after a preemption, rolls
those back to their last token and they run again), then commits as many depths as the
verified rows allow and gives each new beam the K/V of its tokens:

- a running beam with no successor is finished (its blocks released);
- its first successor (best ranked) takes over its request: tokens appended, drafts off its
  path rolled back (``Request.commit_step``), a tree branch's K/V moved into place;
- each further successor is a new request that shares the parent's full blocks below their
  common prefix (``KVCacheManager.fork``: reference counts) and gets its own copy of the rest
  (the partial block, and a tree branch's K/V at its positions); copy on write, done at
  the fork. A draft model's or EAGLE head's cache (same block tables) gets the same copies
  (``Proposer.copy_kv_slots``), and EAGLE hands the new request its share of the target's
  hidden states (``Proposer.fork``). A draft with another tokenizer keeps blocks of its own
  per request: it forks those the same way in ``Proposer.fork``.

Forked beams join the scheduler's running requests at once (``Scheduler.add_running``). With
``dynamic_k`` beams take no probe steps (``Request.takes_draft_probes``): a forked beam is a new
request whose draft cache may hold nothing, so a probe would cost the draft a prefill of its
whole context, and a search commits depths only where every beam's drafts hold. The
group's one ``RequestOutput`` comes when the search is done: the ``beam_width`` best finished
hypotheses, best first, each with its cumulative log-probability.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from specserve.beam_search_params import BeamSearchParams
from specserve.core.kv_cache_manager import KVCacheManager
from specserve.core.request import Request, RequestStatus
from specserve.core.scheduler import ScheduledRequest, Scheduler
from specserve.engine.beam_search import BeamSearchState, Hypothesis, NewBeam, PassBeam
from specserve.engine.step_inputs import drafts_per_depth
from specserve.model_executor.layers.attention import cache_slot
from specserve.outputs import CompletionOutput, Logprob, RequestOutput, SpecDecodeStats
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def beam_capable_proposer(proposer, beam_width: int, max_num_seqs: int, max_num_batched_tokens: int,
                          vocab_size: int) -> None:
    """ValueError naming why this engine cannot run a beam search of ``beam_width`` beams."""
    if proposer is not None and not proposer.runs_beams:
        raise ValueError(f"beam search runs with the ngram, suffix, draft_model and eagle proposers or none; "
                         f"this engine's is {type(proposer).__name__}, which does not say it can follow a forked "
                         f"beam (Proposer.runs_beams)")
    if beam_width > min(max_num_seqs, max_num_batched_tokens):
        raise ValueError(f"beam_width {beam_width} exceeds what one step runs (max_num_seqs {max_num_seqs}, "
                         f"max_num_batched_tokens {max_num_batched_tokens}): every beam needs a place in the same step")
    if 2 * beam_width > vocab_size:
        raise ValueError(f"beam_width {beam_width} needs 2 x {beam_width} candidate tokens; the vocabulary has "
                         f"{vocab_size}")


@dataclass
class RunningBeam:
    request: Request           # its tokens and KV (the prompt, then the generated tokens)
    logprobs: list[float]      # of each generated token
    cum_logprob: float


class BeamSearchGroup:
    """One beam search request: its running beams (best first) and its search."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: BeamSearchParams,
                 search: BeamSearchState, first: Request):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.search = search
        self.running = [RunningBeam(first, [], 0.0)]
        self.num_beams_made = 1
        self.stalled_alone = 0                  # passes in a row it waited for blocks no one else held
        self.spec_stats = SpecDecodeStats()     # per pass and running beam: drafts, depths beyond the first
        self.arrival_time = first.arrival_time
        self.first_pass_time: float | None = None

    def beam_id(self) -> str:
        self.num_beams_made += 1
        return f"{self.request_id}#beam{self.num_beams_made - 1}"


class BeamGroups:
    """The engine's beam search requests, by id and by their running beams' request ids."""

    def __init__(self, kv_cache: KVCacheManager, scheduler: Scheduler, runner, proposer, tokenizer,
                 engine_stats: SpecDecodeStats):
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.runner = runner                  # the target's: copy_kv_slots
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.engine_stats = engine_stats
        self.by_id: dict[str, BeamSearchGroup] = {}
        self._of_beam: dict[str, BeamSearchGroup] = {}
        self.num_deferred = 0     # passes put off: the step held some of a search's beams, not all

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def public_id(self, request_id: str) -> str:
        """The id the user knows: a beam's search's, else the request's own."""
        group = self._of_beam.get(request_id)
        return group.request_id if group is not None else request_id

    def owns(self, request: Request) -> bool:
        return request.request_id in self._of_beam

    def add(self, request_id: str, text: str | None, token_ids: list[int], params: BeamSearchParams,
            max_tokens: int, eos_token_id: int | None, lora_id: int = 0) -> None:
        """Queue the first beam (the prompt). ``max_tokens``: params' cap, within the model's length;
        ``lora_id``: the LoRA adapter every beam runs with (0: none)."""
        beam_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        first = Request(f"{request_id}#beam0", text, token_ids, beam_params, None, eos_token_id)
        first.takes_draft_probes = False
        first.lora_id = lora_id
        group = BeamSearchGroup(request_id, text, list(token_ids), params,
                                BeamSearchState(params, eos_token_id, max_tokens), first)
        self.by_id[request_id] = group
        self._of_beam[first.request_id] = group
        self.scheduler.add_request(first)

    def abort(self, request_id: str) -> None:
        group = self.by_id.pop(request_id, None)
        if group is not None:
            self._end(group, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ a step
    def split(self, sampling: list[ScheduledRequest], num_logits: list[int], logits: torch.Tensor):
        """A step's sampling requests and their logits rows (``num_logits`` each, in order) ->
        (the others, their rows, {beam request id: (its ScheduledRequest, its rows)})."""
        others, keep, beams, row = [], [], {}, 0
        for s, n in zip(sampling, num_logits):
            if self.owns(s.request):
                beams[s.request.request_id] = (s, logits[row : row + n])
            else:
                others.append(s)
                keep.extend(range(row, row + n))
            row += n
        if len(others) == len(sampling):
            return others, logits, beams
        return others, logits[torch.tensor(keep, dtype=torch.long, device=logits.device)], beams

    def advance(self, beams: dict, errors: dict) -> list[RequestOutput]:
        """Run each group whose running beams all have rows this step; -> the finished groups'
        outputs (a group that fails ends alone, its exception filed in ``errors``)."""
        copies: list[tuple[int, int]] = []    # (source slot, destination slot), all read before any write
        ended: list[Request] = []
        stalled: list[BeamSearchGroup] = []    # put off while some of their beams wait for blocks
        outputs = []
        for group in {id(g): g for g in (self._of_beam[rid] for rid in beams)}.values():
            try:
                out = self._advance(group, beams, copies, ended)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                out = self._fail(group, e, errors)
            if out is None and group.request_id in self.by_id and any(
                    b.request.status is RequestStatus.WAITING for b in group.running):
                stalled.append(group)
            if out is not None:
                outputs.append(out)
        if copies:
            src, dst = zip(*copies)
            self.runner.copy_kv_slots(list(src), list(dst))
            if self.proposer is not None:        # a draft model's or EAGLE head's cache: the same copies
                self.proposer.copy_kv_slots(list(src), list(dst))
        for req in ended:
            self._release(req)
        if stalled:
            outputs += self._unstall(stalled, errors)
        return outputs

    def _unstall(self, stalled: list[BeamSearchGroup], errors: dict) -> list[RequestOutput]:
        """Searches whose running beams hold blocks while their other beams wait for blocks
        could wait on each other forever (the scheduler never takes a running request's blocks
        for a waiting one). The oldest goes first: its waiting beams move to the front of the
        queue, and the newer ones give their running beams' blocks up (to the back of the queue;
        computed again when admitted). A search that holds every running request and still waits
        can never fit in the KV cache: after a few passes it fails with a clear error."""
        age = {id(g): i for i, g in enumerate(self.by_id.values())}
        first, *newer = sorted(stalled, key=lambda g: age[id(g)])
        for group in newer:
            group.stalled_alone = 0
            for b in group.running:
                if b.request.status is RequestStatus.RUNNING:
                    self.scheduler.requeue(b.request, front=False)
        for b in reversed(first.running):
            if b.request.status is RequestStatus.WAITING:
                self.scheduler.requeue(b.request, front=True)
        alone = all(self._of_beam.get(r.request_id) is first for r in self.scheduler.running)
        first.stalled_alone = first.stalled_alone + 1 if alone else 0
        if first.stalled_alone < 3:
            return []
        return [self._fail(first, MemoryError(
            f"beam search {first.request_id} needs its {len(first.running)} beams in the KV cache at once, and "
            f"the cache ({self.kv_cache.num_blocks} blocks of {self.kv_cache.block_size} tokens) cannot hold them: "
            f"raise kv_cache_memory, or lower beam_width or max_tokens"), errors)]

    def _fail(self, group: BeamSearchGroup, error: Exception, errors: dict) -> RequestOutput:
        """End one search because of its own failure; its error output (the rest carry on)."""
        logger.error("beam search %s failed: %s", group.request_id, error, exc_info=error)
        errors[group.request_id] = error
        self.by_id.pop(group.request_id, None)
        self._end(group, RequestStatus.FINISHED_ABORTED)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             [CompletionOutput(0, "", [], finish_reason="error")], True, group.spec_stats)

    def _advance(self, group: BeamSearchGroup, beams: dict, copies: list, ended: list) -> RequestOutput | None:
        if not all(b.request.request_id in beams for b in group.running):
            self.num_deferred += 1
            for b in group.running:     # computed again next step, with the others
                if b.request.request_id in beams:
                    s, _ = beams[b.request.request_id]
                    b.request.commit_step(s.num_new_tokens - 1, 0)
            return None
        group.first_pass_time = group.first_pass_time or time.monotonic()
        group.stalled_alone = 0
        passing = [PassBeam(list(b.request.output_token_ids), b.logprobs, b.cum_logprob,
                            beams[b.request.request_id][1], list(b.request.draft_token_ids), b.request.draft_parents)
                   for b in group.running]
        result = group.search.run_pass(passing)
        for b in group.running:
            req = b.request
            per_depth = None if req.draft_parents is None else drafts_per_depth(req.draft_parents)
            accepted = min(result.depths - 1, len(req.draft_token_ids))
            for stats in (req.spec_stats, group.spec_stats, self.engine_stats):
                stats.record(len(req.draft_token_ids), accepted, result.depths, per_depth)
        if result.done:
            ended += [b.request for b in group.running]
            group.running = []
            del self.by_id[group.request_id]
            return self._output(group)
        successors: dict[int, list[NewBeam]] = defaultdict(list)
        for nb in result.running:
            successors[nb.root].append(nb)
        placed: dict[int, Request] = {}       # id(NewBeam) -> its request
        for i, b in enumerate(group.running):
            kids = successors.get(i, [])
            if not kids:
                ended.append(b.request)
                continue
            s, _ = beams[b.request.request_id]
            for nb, req in self._commit(group, b.request, s, kids, result.depths, copies):
                placed[id(nb)] = req
        group.running = [RunningBeam(placed[id(nb)], group.running[nb.root].logprobs + nb.logprobs, nb.cum_logprob)
                         for nb in result.running]
        for req in ended:
            self._of_beam.pop(req.request_id, None)
        return None

    def _commit(self, group: BeamSearchGroup, req: Request, s: ScheduledRequest, kids: list[NewBeam], depths: int,
                copies: list) -> list[tuple[NewBeam, Request]]:
        """A running beam's successors: the first takes over ``req``, the others fork its K/V."""
        length = req.num_tokens                    # its last token is at length - 1, draft i at length + i
        keep = length + depths - 1                 # tokens with K/V after the pass: up to the path's last draft
        table = self.kv_cache.block_table(req.request_id)
        bs = self.kv_cache.block_size

        def in_place(nb: NewBeam) -> int:         # positions whose K/V sits where the successor needs it
            return length + next((d for d, n in enumerate(nb.nodes) if n != d), len(nb.nodes))

        def source(nb: NewBeam, position: int) -> int:
            return position if position < length else length + nb.nodes[position - length]

        first = kids[0]
        # The draft model's cache holds this beam's chain in place; a tree's nodes it lays out its own way.
        drafted_to = req.proposer_num_computed_tokens if req.draft_parents is None else min(
            req.proposer_num_computed_tokens, length)
        placed = []
        for nb in kids[1:]:
            child = Request(group.beam_id(), req.prompt, req.prompt_token_ids, req.sampling_params, None,
                            req.eos_token_id)
            child.takes_draft_probes = False
            child.lora_id = req.lora_id
            for t in req.output_token_ids + nb.tokens:
                child.append_token(t)
            self._of_beam[child.request_id] = group
            shared = self.kv_cache.fork(req.request_id, child.request_id, min(in_place(nb), in_place(first), keep))
            if self.kv_cache.allocate_slots(child.request_id, keep):
                own = self.kv_cache.block_table(child.request_id)
                copies += [(cache_slot(table, source(nb, p), bs), cache_slot(own, p, bs)) for p in range(shared, keep)]
                child.num_computed_tokens = keep
                child.proposer_num_computed_tokens = min(drafted_to, in_place(nb), keep)
                self.kv_cache.cache_request_blocks(child, keep)
                self.scheduler.add_running(child)
                if self.proposer is not None:
                    self.proposer.fork(req, child, nb.nodes, length - 1)
            else:        # no room: it computes its K/V again when admitted (its prefix from the cache)
                self.kv_cache.free(child.request_id)
                self.scheduler.add_request(child)
            placed.append((nb, child))
        copies += [(cache_slot(table, source(first, p), bs), cache_slot(table, p, bs))
                   for p in range(length, keep) if source(first, p) != p]
        if req.draft_parents is not None and self.proposer is not None:
            # The draft moves its own K/V of the first successor's path into place (a draft tree's
            # proposer; others do nothing) and says how far its cache now holds.
            before = req.proposer_num_computed_tokens
            self.proposer.keep_tree_branch(req, first.nodes, length - 1)
            moved = req.proposer_num_computed_tokens != before
            first_drafted = req.proposer_num_computed_tokens if moved else drafted_to
        else:
            first_drafted = min(drafted_to, in_place(first))
        req.commit_step(s.num_new_tokens, depths - 1)
        req.proposer_num_computed_tokens = min(req.proposer_num_computed_tokens, first_drafted)
        for t in first.tokens:
            req.append_token(t)
        self.kv_cache.cache_request_blocks(req, keep)
        return [(first, req)] + placed

    # ------------------------------------------------------------------ the end
    def _end(self, group: BeamSearchGroup, status: RequestStatus) -> None:
        for b in group.running:
            self._of_beam.pop(b.request.request_id, None)
            self._release(b.request, status)
        group.running = []

    def _release(self, req: Request, status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        self._of_beam.pop(req.request_id, None)
        if not req.is_finished():
            req.finish_time = time.monotonic()
            self.scheduler.finish(req, status)

    def _output(self, group: BeamSearchGroup) -> RequestOutput:
        outs = [self._completion(i, h) for i, h in enumerate(group.search.results())]
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=outs, finished=True, spec_decode_stats=group.spec_stats,
            metrics={"arrival_time": group.arrival_time, "first_token_time": group.first_pass_time,
                     "finish_time": time.monotonic()},
        )

    def _completion(self, index: int, h: Hypothesis) -> CompletionOutput:
        text_tokens = h.tokens[:-1] if h.finish_reason == "stop" else h.tokens
        eos = self.tokenizer.eos_token_id
        return CompletionOutput(
            index=index,
            text=self.tokenizer.decode(text_tokens, skip_special_tokens=True),
            token_ids=list(h.tokens),
            finish_reason=h.finish_reason,
            stop_reason=eos if h.finish_reason == "stop" else None,
            logprobs=[{t: Logprob(lp, rank=None)} for t, lp in zip(h.tokens, h.logprobs)],
            cumulative_logprob=h.cum_logprob,
        )
