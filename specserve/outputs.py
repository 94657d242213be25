"""What `LLM.generate` returns: the vLLM shapes, plus speculative-decoding stats."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counts of one request's (or the whole engine's) speculation.

    acceptance rate = accepted / draft tokens; mean acceptance length (tau) =
    emitted tokens per verification step, bonus/recovered included, so plain
    decoding is 1.0.
    """

    num_drafts: int = 0            # verification steps that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0    # tokens emitted by all decode steps (drafted or not)
    num_steps: int = 0             # decode steps (with or without drafts)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    steps_by_draft_length: list[int] = field(default_factory=list)   # [i]: decode steps that carried i drafts

    def record(self, num_draft: int, num_accepted: int, num_emitted: int,
               drafts_per_depth: list[int] | None = None) -> None:
        """One decode step. ``drafts_per_depth[p]``: draft tokens at position p + 1 after
        the last token (a tree of drafts may hold several); default a chain, one each."""
        self.num_steps += 1
        self.num_emitted_tokens += num_emitted
        _bump(self.steps_by_draft_length, num_draft)
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_depth = [1] * num_draft if drafts_per_depth is None else drafts_per_depth
        while len(self.drafted_per_position) < len(per_depth):
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for pos, count in enumerate(per_depth):
            self.drafted_per_position[pos] += count
            if pos < num_accepted:
                self.accepted_per_position[pos] += 1

    def merge(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_steps += other.num_steps
        n = max(len(self.drafted_per_position), len(other.drafted_per_position))
        for lst in (self.drafted_per_position, self.accepted_per_position):
            lst.extend([0] * (n - len(lst)))
        for i, v in enumerate(other.drafted_per_position):
            self.drafted_per_position[i] += v
        for i, v in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += v
        for i, v in enumerate(other.steps_by_draft_length):
            _bump(self.steps_by_draft_length, i, v)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_steps": self.num_steps,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "steps_by_draft_length": list(self.steps_by_draft_length),
        }


def _bump(counts: list[int], index: int, by: int = 1) -> None:
    counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += by


# How an emitted token came (``CompletionOutput.token_sources``).
TOKEN_SOURCE_PLAIN = "plain"          # a step without drafts (prefill's token, no n-gram match, k = 0)
TOKEN_SOURCE_ACCEPTED = "accepted"    # a draft token the target accepted
TOKEN_SOURCE_RECOVERED = "recovered"  # the target's own token where it rejected a draft
TOKEN_SOURCE_BONUS = "bonus"          # the target's extra token after every draft on its path was accepted
TOKEN_SOURCES = (TOKEN_SOURCE_PLAIN, TOKEN_SOURCE_ACCEPTED, TOKEN_SOURCE_RECOVERED, TOKEN_SOURCE_BONUS)


def step_token_sources(num_drafts: int, num_accepted: int, ends_at_leaf: bool) -> list[str]:
    """Sources of the ``num_accepted + 1`` tokens one verification step emits.

    ``ends_at_leaf``: the last accepted draft (or the last token, when none was)
    has no draft below it, so the target's final token is a bonus, not a
    correction. For a chain that is ``num_accepted == num_drafts``."""
    if num_drafts == 0:
        return [TOKEN_SOURCE_PLAIN]
    last = TOKEN_SOURCE_BONUS if ends_at_leaf else TOKEN_SOURCE_RECOVERED
    return [TOKEN_SOURCE_ACCEPTED] * num_accepted + [last]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None          # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None      # the stop string or stop token that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per token: chosen + top n
    token_sources: list[str] = field(default_factory=list)  # one TOKEN_SOURCE_* per token id
    spec_decode_stats: SpecDecodeStats | None = None        # this completion's own (RequestOutput's sums n samples)
    cumulative_logprob: float | None = None   # beam search's: the sum of its tokens' log-probabilities

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_decode_stats: SpecDecodeStats | None = None
    metrics: dict = field(default_factory=dict)   # arrival/first-token/finish times (seconds)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else its entry (chosen + top n)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def logprob_entries(tokenizer, chosen: int, chosen_logprob: float, top_ids: list[int], top_lps: list[float]) -> dict[int, Logprob]:
    entry = {chosen: Logprob(chosen_logprob, rank=None, decoded_token=tokenizer.decode([chosen]))}
    for rank, (tid, lp) in enumerate(zip(top_ids, top_lps), start=1):
        if tid == chosen:
            entry[chosen].rank = rank
        else:
            entry[tid] = Logprob(lp, rank=rank, decoded_token=tokenizer.decode([tid]))
    return entry


@dataclass
class EmbeddingOutput:
    embedding: list[float]        # [hidden], pooled (and L2-normalized where asked)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's shape: ``outputs.embedding``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
