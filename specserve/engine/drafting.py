"""The drafting half of a step: ask the proposer for each decoding request's drafts, with
the draft length per request when ``dynamic_k`` is on (``spec_decode.k_policy``).

With ``dynamic_k``, a proposer whose drafts cost nothing (``Proposer.drafts_are_free``:
n-gram, suffix) proposes the full K first; the policy then keeps the part of each proposal
that pays, and every proposal is scored against the tokens the target emits next
(``spec_decode.shadow_drafts``), so acceptance is learned without drafting to measure it.
Where the lookups cost a measurable share of the forward (large batches), a request whose
proposals the policy keeps cutting to nothing is looked up only every ``LOOKUP_EVERY``
steps (``LookupBackoff``), so such steps cost about what plain decoding costs; a lookup
that pays again brings it back at once.
A proposer that costs a forward per draft (draft model, EAGLE) is asked for the lengths the
policy picks beforehand, from the acceptance of verified drafts and periodic probes; a probe
runs only where it could pay for the catch-up it costs (``DraftLengthPolicy.probe_pays``).

The engine owns the proposer and passes it in; a failing proposer only costs this step its
drafts: every request still gets its exact next token from the target. After the target's
forward, ``show_hidden_states`` hands proposers that ask for it (EAGLE) the target's hidden
states of the positions kept, and ``record_step_costs`` feeds dynamic_k's cost model.
"""
from __future__ import annotations

import logging
import time
from weakref import WeakKeyDictionary

from specserve.core.request import Request
from specserve.core.scheduler import ScheduledRequest
from specserve.outputs import SpecDecodeStats
from specserve.spec_decode.k_policy import DraftLengthPolicy
from specserve.spec_decode.proposer import kept_hidden_states
from specserve.spec_decode.shadow_drafts import ShadowDrafts
from specserve.worker.model_runner import ForwardInput

logger = logging.getLogger(__name__)

# A request whose proposal the policy cut to 0 tokens this many steps in a row (a proposal
# there, but verifying it does not pay) is then looked up once every LOOKUP_EVERY steps,
# in steps where the lookups (and their bookkeeping) cost at least LOOKUP_SHARE of the
# forward: at batch 1 they cost ~0.7% of it (0.10 of ~15 ms), at batch 8 and 64 ~2%; batch 1
# keeps every lookup, since a quoted stretch can start at any token.
CUTS_BEFORE_BACKOFF = 2
LOOKUP_EVERY = 4
LOOKUP_SHARE = 0.015


class LookupBackoff:
    """Which decoding requests a free proposer looks up this step (dynamic_k only).

    At batch 64 a lookup and its bookkeeping cost ~3.5 ms a step (about 2% of it), spent
    for nothing when the policy verifies none of it. Requests with no proposal at all keep
    being looked up every step: a match can start at any token, and it is cheap to miss.
    """

    def __init__(self) -> None:
        self._cuts: WeakKeyDictionary[Request, int] = WeakKeyDictionary()   # consecutive cuts to 0
        self._wait: WeakKeyDictionary[Request, int] = WeakKeyDictionary()   # steps left to sit out

    def skips(self, request: Request) -> bool:
        """True when ``request`` sits this step out (counts the step)."""
        wait = self._wait.get(request, 0)
        if wait > 0:
            self._wait[request] = wait - 1
            return True
        return False

    def chosen(self, request: Request, proposed: int, kept: int) -> None:
        """The policy kept ``kept`` of the ``proposed`` tokens looked up for ``request``."""
        if proposed > 0 and kept == 0:
            cuts = self._cuts[request] = self._cuts.get(request, 0) + 1
            if cuts >= CUTS_BEFORE_BACKOFF:
                self._wait[request] = LOOKUP_EVERY - 1
        elif kept > 0:
            self._cuts[request] = 0


MIN_ADAPTER_DRAFTS = 32   # draft tokens a LoRA adapter's requests propose before their prior is its own


class Drafting:
    def __init__(self, disable_by_batch_size: int | None, k_policy: DraftLengthPolicy | None,
                 engine_stats: SpecDecodeStats, max_model_len: int):
        self.disable_by_batch_size = disable_by_batch_size
        self.max_model_len = max_model_len    # a request's tokens left: what a probe's catch-up can pay off over
        self.k_policy = k_policy
        self.engine_stats = engine_stats      # the engine-wide acceptance (the policy's prior)
        # the same by LoRA adapter (0: the base model): with adapters, a request's prior is its adapter's,
        # whose drafts (proposed without the adapter) are accepted at a rate of their own
        self.stats_by_adapter: dict[int, SpecDecodeStats] = {}
        self.propose_seconds = 0.0            # this step's proposer time (dynamic_k's cost model)
        self.shadows = ShadowDrafts() if k_policy is not None else None   # free proposers' scored proposals
        self.backoff = LookupBackoff()
        self.lookup_seconds_per_request = 0.0   # the last lookup step's, bookkeeping included

    def propose_or_skip(self, proposer, scheduled: list[ScheduledRequest]) -> None:
        """Set each decoding request's drafts, or none if the proposer fails."""
        self.propose_seconds = 0.0
        try:
            self._propose(proposer, scheduled)
        except Exception:  # noqa: BLE001
            logger.exception("the proposer failed; this step runs without draft tokens")
            for s in scheduled:
                s.request.clear_drafts()

    def _propose(self, proposer, scheduled: list[ScheduledRequest]) -> None:
        if proposer is None:
            return
        decoding = [s for s in scheduled if s.num_lookahead > 0]
        limit = self.disable_by_batch_size
        if limit is not None and len(decoding) >= limit:
            return  # plain decoding this step; the reserved lookahead slots stay unused
        if not decoding:
            return
        if self.k_policy is not None and proposer.drafts_are_free:
            self._propose_then_trim(proposer, decoding)
            return
        if self.k_policy is not None:
            self._choose_draft_lengths(proposer, decoding)
            decoding = [s for s in decoding if s.num_lookahead > 0]
            if not decoding:
                return
        catch_up = sum(self.k_policy.extra_catch_up(proposer.catch_up_tokens(s.request)) for s in decoding) \
            if self.k_policy is not None else 0
        started = time.perf_counter()
        proposal = proposer.propose(decoding)
        if self.k_policy is not None:
            self.propose_seconds = time.perf_counter() - started
            # by the drafts made: a proposer may make fewer than asked, or none (an EAGLE head
            # without the target's features for a request yet returns at once)
            drafted = max((len(tokens) for tokens in proposal.token_ids), default=0)
            self.k_policy.record_draft(drafted, self.propose_seconds, catch_up)
        self._set_drafts(proposer, decoding, proposal)

    @staticmethod
    def _set_drafts(proposer, decoding: list[ScheduledRequest], proposal) -> None:
        parents = proposal.parents or [None] * len(decoding)
        for s, tokens, probs, tree in zip(decoding, proposal.token_ids, proposal.probs, parents):
            s.request.draft_token_ids = list(tokens[: s.num_lookahead])
            s.request.draft_probs = probs
            # Parents come before children, so the first num_lookahead nodes are still a tree.
            s.request.draft_parents = None if tree is None else list(tree[: s.num_lookahead])
            if tree is not None and proposer.needs_target_hidden and not proposer.takes_tree_hidden:
                raise ValueError("this proposer reads the target's hidden states by position: no trees")
            if tree is not None and probs is not None:
                s.request.draft_probs = probs[: s.num_lookahead]   # per node: its parent's distribution

    def _propose_then_trim(self, proposer, decoding: list[ScheduledRequest]) -> None:
        """A free proposer's full proposals, each remembered for scoring, then cut to the
        lengths the policy picks (their lookahead slots stay reserved, unused); a seeded request's
        tokens do not depend on them (``sample.verify``). Requests the back-off sits out this step
        get no lookup and no drafts."""
        started = time.perf_counter()
        policy, asked = self.k_policy, []
        back_off = (policy.forward.known() and self.lookup_seconds_per_request * len(decoding)
                    >= LOOKUP_SHARE * policy.forward(len(decoding)))
        for s in decoding:
            if back_off and self.backoff.skips(s.request):
                s.num_lookahead = 0
                s.request.clear_drafts()
            else:
                asked.append(s)
        if not asked:
            return
        proposal = proposer.propose(asked)
        parents = proposal.parents or [None] * len(asked)
        for s, tokens, tree in zip(asked, proposal.token_ids, parents):
            self.shadows.remember(s.request, tokens[: s.num_lookahead], None if tree is None else tree[: s.num_lookahead])
        rates = []
        limits = [min(len(tokens), s.num_lookahead) for s, tokens in zip(asked, proposal.token_ids)]
        for s, size in zip(asked, limits):
            own = self.shadows.of(s.request, size)
            rates.append(policy.acceptance(own.gained, own.proposed, self.shadows.engine(size).rates()))
        for s, size, k in zip(asked, limits, policy.choose(rates, limits, [False] * len(asked))):
            s.num_lookahead = k
            self.backoff.chosen(s.request, size, k)
        self._set_drafts(proposer, asked, proposal)
        self.lookup_seconds_per_request = (time.perf_counter() - started) / len(asked)

    def score_proposals(self, scheduled: list[ScheduledRequest]) -> None:
        """After a step's tokens are appended: score the remembered proposals they decide."""
        if self.shadows is not None:
            for s in scheduled:
                self.shadows.score(s.request)

    def record_step_costs(self, scheduled: list[ScheduledRequest], inputs: list[ForwardInput], step_started: float,
                          forward_started: float, verified_at: float) -> None:
        """dynamic_k's cost model learns from decoding steps only (every request one new token):
        the forward's time by rows verified, and what the step spent besides it and the proposer."""
        if self.k_policy is None or any(s.num_new_tokens != 1 for s in scheduled):
            return
        forward_seconds = verified_at - forward_started
        self.k_policy.record_forward(sum(len(i.token_ids) for i in inputs), forward_seconds)
        overhead = time.perf_counter() - step_started - forward_seconds - self.propose_seconds
        self.k_policy.record_overhead(overhead)

    @staticmethod
    def show_hidden_states(proposer, scheduled: list[ScheduledRequest], inputs: list[ForwardInput],
                           starts: list[int], all_hidden) -> None:
        """The target's hidden states of every position each request kept, to the proposer
        (``starts``: each request's num_computed_tokens before the step)."""
        sizes = [len(i.token_ids) for i in inputs]
        trees = [i.tree_parents is not None for i in inputs]
        try:
            proposer.observe(kept_hidden_states(scheduled, sizes, starts, all_hidden, trees))
        except Exception:  # noqa: BLE001 - stale proposer state only costs acceptance
            logger.exception("the proposer failed to observe the target's hidden states")

    def record_adapter_step(self, lora_id: int, num_drafts: int, num_accepted: int, num_emitted: int,
                            per_depth: list[int] | None) -> None:
        """A decode step's counts, under the request's LoRA adapter (0: none)."""
        self.stats_by_adapter.setdefault(lora_id, SpecDecodeStats()).record(num_drafts, num_accepted, num_emitted,
                                                                            per_depth)

    def prior_for(self, lora_id: int) -> list[float]:
        """The acceptance by position a request starts from: its LoRA adapter's once that has drafted
        MIN_ADAPTER_DRAFTS tokens and adapters are in use, else the engine-wide one."""
        stats = self.stats_by_adapter.get(lora_id)
        if len(self.stats_by_adapter) < 2 or stats is None or stats.num_draft_tokens < MIN_ADAPTER_DRAFTS:
            stats = self.engine_stats
        return self.k_policy.prior(stats.accepted_per_position, stats.drafted_per_position)

    def _choose_draft_lengths(self, proposer, decoding: list[ScheduledRequest]) -> None:
        """Lower each request's lookahead to the draft length the policy picks (its slots stay
        reserved, unused); a seeded request's tokens do not depend on it (``sample.verify``)."""
        policy = self.k_policy
        priors = {lora_id: self.prior_for(lora_id) for lora_id in {s.request.lora_id for s in decoding}}
        rates = [policy.acceptance(s.request.spec_stats.accepted_per_position,
                                   s.request.spec_stats.drafted_per_position, priors[s.request.lora_id])
                 for s in decoding]
        probe = [s.request.takes_draft_probes and policy.is_probe_step(s.request.spec_stats.num_steps)
                 and policy.probe_pays(s.request.spec_stats.accepted_per_position,
                                       s.request.spec_stats.drafted_per_position, priors[s.request.lora_id],
                                       self._tokens_left(s.request),
                                       policy.extra_catch_up(proposer.catch_up_tokens(s.request)))
                 for s in decoding]
        for s, k in zip(decoding, policy.choose(rates, [s.num_lookahead for s in decoding], probe)):
            s.num_lookahead = k

    def _tokens_left(self, request: Request) -> int:
        return min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)


# Tokens a draft model catches up in a step of steady drafting, what its calibrated first
# forward reads: the last step's bonus (or recovered) token, and its last draft when every draft
# was accepted. (An EAGLE head recomputes the accepted positions too, up to K + 1: so a step's
# catch-up counts as longer only past K + 1, ``DraftLengthPolicy.extra_catch_up``.)
STEADY_CATCH_UP = 2

# Rows a calibrating draft forward catches up beyond the steady ones, to price a probe's
# catch-up per row (a prompt's is longer: the cost per row is carried over linearly).
CATCH_UP_CALIBRATION_ROWS = 16


def calibration_rows(k: int) -> list[int]:
    """The row counts timed at start-up: every count up to 5 (where the CPU kernels change
    path: one row, a fused few-row path, tiles), then every other one, and always k + 1. The
    policy interpolates between them until a step measures a skipped count itself."""
    return sorted({r for r in range(1, k + 2) if r <= 5 or r % 2 == 1} | {k + 1})


def calibrate_k_policy(policy: DraftLengthPolicy, runner, draft_runner, k: int, max_model_len: int,
                       blocks_for) -> None:
    """Time target forwards of ``calibration_rows(k)`` rows (and a draft-model step, given its
    runner) on scratch KV slots, before any request exists, so the policy starts with measured
    costs. ``blocks_for(n)``: the number of KV blocks n tokens take (``KVCacheManager.blocks_for``).

    Its cost, a warm-up and two target forwards per row count, is in docs/speculative_decoding.md
    (about 0.15-0.35 s on the default model, 2-3.7 s on Qwen2.5-Coder-1.5B with float32 activations).

    The draft model's forwards are timed the way a proposal runs them: a steady proposal of k
    drafts is one forward over the ``STEADY_CATCH_UP`` tokens caught up, then k - 1 one-row
    forwards; a probe catches up more rows in its first forward (timed on
    ``CATCH_UP_CALIBRATION_ROWS`` more)."""
    for rows, seconds in _fastest_forwards(runner, calibration_rows(k), k + 1, max_model_len, blocks_for,
                                           logits_of_every_row=True).items():
        policy.calibrate_forward(rows, seconds)
    if draft_runner is not None:
        steady = min(STEADY_CATCH_UP, max_model_len)
        long = min(steady + CATCH_UP_CALIBRATION_ROWS, max_model_len)
        times = _fastest_forwards(draft_runner, [1, steady, long], long, max_model_len, blocks_for,
                                  logits_of_every_row=False)
        policy.draft.calibrate(times[steady], times[1], max(times[long] - times[steady], 0.0) / max(long - steady, 1))


def _fastest_forwards(runner, row_counts: list[int], most_rows: int, max_model_len: int, blocks_for,
                      logits_of_every_row: bool) -> dict[int, float]:
    """The faster of two timed forwards per row count (one spike is ignored), after an untimed
    warm-up, on scratch KV slots at a short context, as early decoding has. Logits for every row
    (a verification) or the last only (a draft's catch-up)."""
    start = max(0, min(64, max_model_len - most_rows - 1))
    block_table = list(range(blocks_for(start + most_rows)))
    runner.execute([ForwardInput([0] * most_rows, start, block_table, most_rows if logits_of_every_row else 1)])
    timings: dict[int, list[float]] = {rows: [] for rows in row_counts}
    # Each timed forward ends by reading one logit: on a GPU the forward runs asynchronously (a
    # replayed CUDA graph returns at once), and only the read waits for it to finish.
    for _ in range(2):
        for rows in timings:
            started = time.perf_counter()
            runner.execute([ForwardInput([0] * rows, start, block_table, rows if logits_of_every_row else 1)]
                           ).logits[-1, 0].item()
            timings[rows].append(time.perf_counter() - started)
    return {rows: min(seconds) for rows, seconds in timings.items()}
