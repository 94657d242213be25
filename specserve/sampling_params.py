"""Per-request sampling parameters (the vLLM names, so users feel at home)."""
from __future__ import annotations

from dataclasses import dataclass, field

# Larger than any real vocabulary's useful top-k; -1 or 0 means "no top-k".
_MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 means greedy (argmax); top_k <= 0 (or -1) disables top-k;
    top_p 1.0 and min_p 0.0 disable those filters. ``seed`` makes a request's
    random choices reproducible alone or in any batch. ``logprobs=n`` returns the
    chosen token's log-probability and the top n alternatives (0 = chosen only).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid SamplingParams: {msg}")

        if self.n != 1:
            raise bad(f"n must be 1 (got {self.n}); send the prompt several times instead")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= _MAX_LOGPROBS):
            raise bad(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
