"""One request's state as it moves through the engine."""
from __future__ import annotations

import enum
import time

import torch

from specserve.outputs import Logprob, SpecDecodeStats
from specserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # not scheduled yet, or preempted (its KV was dropped)
    RUNNING = "running"        # holds KV blocks
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length" # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


def request_seed(params: SamplingParams, seed_rng: torch.Generator) -> int | None:
    """The seed of a sampled request's random numbers: its own, or else the next of the engine's
    seed sequence; None for greedy requests. The sampler keys every number by this seed and the
    output index it decides (``sample.sampler.keyed_generator``)."""
    if params.greedy:
        return None
    return params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=seed_rng))


class Request:
    """Token ids, how many of them have KV in the cache, and what to emit.

    ``num_computed_tokens`` counts the tokens whose KV is in the target's cache.
    The engine schedules ``num_tokens - num_computed_tokens`` more (a prefill
    chunk, or the last sampled token) plus up to k draft tokens; rejection of
    draft tokens lowers it again (their KV slots are simply overwritten later).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        seed: int | None,
        eos_token_id: int | None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.seed = seed                      # keys its random numbers (request_seed); None for greedy
        self.eos_token_id = eos_token_id
        self.bad_words_ids: list[list[int]] = []   # SamplingParams.bad_words as token sequences (the engine's)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0             # of the prompt, found in the prefix cache at admission
        self.status = RequestStatus.WAITING
        self.priority = 0                     # lower runs first under scheduling_policy "priority"
        self.lora_id = 0                      # its LoRA adapter's id (0: the base model alone)
        self.num_preemptions = 0
        # Speculation: draft tokens proposed for this step, and how many of this
        # request's tokens the proposer's own KV cache holds (draft model / EAGLE).
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None   # [n, V] processed draft probs, None = one-hot
        self.draft_parents: list[int] | None = None    # a tree of drafts: parent of each (-1 = last token)
        self.proposer_num_computed_tokens = 0
        self.spec_stats = SpecDecodeStats()
        # dynamic_k's probe steps (a draft length tried where the policy would draft less): off for
        # beam search's beams (engine.beam_groups), whose probes would cost the draft a prefill.
        self.takes_draft_probes = True
        # Structured output: the request's matcher (structured_output.matcher.RequestGrammar), which
        # stands after the output so far, and this step's masks; None when unconstrained.
        self.grammar = None
        # Output bookkeeping.
        self.output_text = ""
        self.detok_prefix_offset = 0           # stop strings: output_text is decoded incrementally
        self.detok_read_offset = 0             # from these (engine.output_processor)
        self.token_sources: list[str] = []     # how each output token came (outputs.TOKEN_SOURCE_*)
        self.logprobs: list[dict[int, Logprob]] | None = [] if sampling_params.logprobs is not None else None
        # prompt_logprobs: one entry per prompt token, None for the first (nothing comes before it);
        # filled as the prompt's positions are computed (engine/prompt_logprobs.py).
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        self.stop_reason: str | int | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def cache_root(self) -> int | None:
        """What its cached prefix blocks are keyed under besides their tokens (core.kv_cache_manager):
        its LoRA adapter, whose K/V differs from the base model's."""
        return self.lora_id or None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """prompt_logprobs were asked for and some prompt token has none yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        return mt if mt is not None else 1 << 30

    # ---- the KV bookkeeping of a step: the only code that moves num_computed_tokens after
    # admission (the scheduler sets it from the prefix cache when it admits a request) ----
    def commit_step(self, num_scheduled: int, num_accepted: int | None) -> None:
        """After a forward of ``num_scheduled`` new tokens plus this step's drafts: all of them
        have K/V now. With ``num_accepted`` (the step was verified), the rejected drafts' K/V is
        given up again (their slots are overwritten later), the proposer's own count is clamped
        to what the target keeps, and the drafts are cleared."""
        self.num_computed_tokens += num_scheduled + len(self.draft_token_ids)
        if num_accepted is None:
            return
        self.num_computed_tokens -= len(self.draft_token_ids) - num_accepted
        self.proposer_num_computed_tokens = min(self.proposer_num_computed_tokens, self.num_computed_tokens)
        self.clear_drafts()

    def clear_drafts(self) -> None:
        self.draft_token_ids, self.draft_probs, self.draft_parents = [], None, None

    def discard_kv(self) -> None:
        """Preempted: its K/V (the target's and the proposer's) is gone; it starts again from
        its tokens so far."""
        self.num_computed_tokens = 0
        self.proposer_num_computed_tokens = 0
        self.clear_drafts()

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
