"""``SamplingParams.prompt_logprobs``: which rows of a step's logits hold a request's prompt
positions, and their entries.

The runner returns logits at the last ``num_logits`` new tokens of each request. A request that
collects prompt log-probabilities widens that window back to the first prompt position still
without an entry, so its rows of the step's logits are

    [lead rows][sampling rows: its drafts + 1, when the step samples for it]

and the first ``count`` lead rows are prompt positions: row i, at position p, gives the entry of
prompt token p + 1. The other lead rows (positions past the prompt, computed again after a
preemption) are dropped. Such a request takes no prefix cache hit (``core/scheduler.py``): every
prompt position goes through a forward, and its prefill chunks are at most the scheduler's
``MAX_PROMPT_LOGPROB_CHUNK`` tokens, which bounds the [rows, vocabulary] logits a step holds.
An entry collected before a preemption is kept; the recomputation adds none.
"""
from __future__ import annotations

import torch

from specserve.core.request import Request
from specserve.sample.logprobs import logprob_rows


def prompt_rows(req: Request, start: int, num_new: int, will_sample: bool) -> tuple[int, int]:
    """(lead, count) for a step computing positions [start, start + num_new) of ``req``: the
    logits rows it needs before its sampling rows, and how many of them are prompt positions."""
    if not req.needs_prompt_logprobs:
        return 0, 0
    first = len(req.prompt_logprobs) - 1            # the position whose logits give the next entry
    end = min(start + num_new, req.num_prompt_tokens - 1)
    if first >= end:
        return 0, 0
    assert first >= start, f"prompt position {first} is not computed again (a prefix cache hit?)"
    return start + num_new - first - int(will_sample), end - first


def add_prompt_logprobs(req: Request, logits: torch.Tensor, tokenizer) -> None:
    """Append the entries of the prompt tokens after the ``len(logits)`` positions whose logits
    these are (``logits`` [count, V] raw, float32, in position order)."""
    first = len(req.prompt_logprobs) - 1
    targets = req.prompt_token_ids[first + 1 : first + 1 + logits.shape[0]]
    req.prompt_logprobs.extend(logprob_rows(tokenizer, logits, targets, req.sampling_params.prompt_logprobs))
