"""A response's prompt parts: /v1/completions' ``echo`` (the prompt's text before each choice's,
and with ``logprobs`` its tokens' logprobs first, the first token's null) and vLLM's
``prompt_logprobs`` field ({token id: {logprob, rank, decoded_token}} per prompt token, the
first null). The engine computes the entries (``SamplingParams.prompt_logprobs``)."""
from __future__ import annotations

from specserve.entrypoints.openai.response_format import clean_logprob, completion_shape
from specserve.outputs import RequestOutput


def prompt_text(tokenizer, out: RequestOutput) -> str:
    """The prompt as the request gave it, or decoded where it came as token ids."""
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


def echo_logprobs(tokenizer, out: RequestOutput, num_top: int | None) -> dict | None:
    """The prompt tokens in /v1/completions' logprobs shape (offsets from 0); None without
    logprobs."""
    if num_top is None or out.prompt_logprobs is None:
        return None
    return completion_shape(tokenizer, zip(out.prompt_token_ids, out.prompt_logprobs), num_top, 0)


def joined(first: dict | None, then: dict | None) -> dict | None:
    """Two /v1/completions logprobs objects one after the other (either may be None)."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in first}


def prompt_logprobs_json(out: RequestOutput) -> list | None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt's token and the top n (rank null: outside the top n)."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(tid): {"logprob": clean_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()}
            for entry in out.prompt_logprobs]
