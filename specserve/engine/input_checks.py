"""A request's input checked before any work starts; every refusal is a ValueError naming it."""
from __future__ import annotations

from specserve.sampling_params import SamplingParams


def prepare_prompt(prompt, tokenize, vocab_size: int, max_model_len: int,
                   truncate: int | None = None) -> tuple[str | None, list[int]]:
    """A prompt (text or token ids) -> (its text or None, its token ids). ``truncate``
    (SamplingParams.truncate_prompt_tokens): keep the last k tokens (-1: max_model_len - 1);
    the text is then None, since it no longer matches the ids."""
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenize(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        text, token_ids = None, list(prompt)
    else:
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty")
    keep = max_model_len - 1 if truncate == -1 else truncate
    if keep is not None and len(token_ids) > keep:
        text, token_ids = None, token_ids[-keep:]
    bad = [t for t in token_ids if not (0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt is {len(token_ids)} tokens long, but max_model_len is {max_model_len} "
            "(at least one token must fit after it)"
        )
    return text, token_ids


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: token ids against this model's vocabulary."""
    for name, ids in (("logit_bias", list(params.logit_bias or {})),
                      ("allowed_token_ids", params.allowed_token_ids or [])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} token ids out of range [0, {vocab_size}): {bad[:5]}")


MAX_PRIORITY = (1 << 31) - 1


def check_priority(priority, scheduling_policy: str) -> None:
    """A request's priority: an integer (lower first), other than 0 only under the "priority" policy,
    as vLLM has it."""
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > MAX_PRIORITY:
        raise ValueError(f"priority must be an integer in [-2^31 + 1, 2^31 - 1], got {priority!r}")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"priority {priority} needs the priority scheduling policy (scheduling_policy='priority', "
                         f"--scheduling-policy priority); this engine serves first come, first served")
