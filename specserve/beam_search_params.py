"""Beam search's parameters and results, in vLLM's shapes (``LLM.beam_search``).

The search itself is ``engine.beam_search`` (its docstring states the algorithm and how
speculation keeps it exact). Its semantics are Hugging Face transformers' ``num_beams``
search without sampling, which is the reference the slow tests compare against:

- each step the 2B best continuations of all running beams (cumulative log-probability,
  the model's own ``log_softmax``) are ranked; those among the best B that end (EOS, or
  ``max_tokens`` reached) become finished hypotheses scored
  ``cum_logprob / generated_len ** length_penalty`` (generated_len counts the EOS token);
  the best B that do not end keep running;
- ``early_stopping``: ``True`` stops once B hypotheses are finished; ``False`` (the default)
  and ``"never"`` stop once the best running beam, length-normalized at the current length
  (``"never"`` with a positive length_penalty: at ``max_tokens``), can no longer beat the
  worst of B finished hypotheses. With ``length_penalty=0`` both are exact beam search.

vLLM's own beam search differs in two details: its length normalization counts the prompt
tokens, and it keeps every EOS continuation (not only those among the best B). specserve
follows transformers there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.outputs import Logprob

EARLY_STOPPING = (False, True, "never")


@dataclass
class BeamSearchParams:
    """``beam_width`` beams, at most ``max_tokens`` new tokens each.

    ``temperature`` is accepted for vLLM's signature and changes nothing: beams are ranked by
    the model's own log-probabilities (as in transformers' search without sampling).
    ``ignore_eos``: EOS is an ordinary token (beams end at max_tokens only)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not any(self.early_stopping is v if isinstance(v, bool) else self.early_stopping == v
                   for v in EARLY_STOPPING):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp or abs(lp) == float("inf"):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 <= t < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")


@dataclass
class BeamSearchSequence:
    """One finished beam. As in vLLM, ``tokens`` holds the prompt's tokens and then the
    generated ones, and ``text`` the generated text (an ending EOS left out)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]     # per generated token: {token: its log-probability}
    cum_logprob: float = 0.0               # sum of the generated tokens' log-probabilities
    score: float = 0.0                     # cum_logprob / generated_len ** length_penalty: the ranking
    text: str | None = None
    finish_reason: str | None = None       # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best finished beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
