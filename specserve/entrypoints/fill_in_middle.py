"""Fill in the middle: what goes between a prefix and a suffix, for code models trained on it
(Qwen2.5-Coder, StarCoder-style tokenizers). The OpenAI API asks for it with ``suffix`` on
/v1/completions (``specserve generate --suffix``).

The prompt is the prefix-suffix-middle order these models learned:
``<fim_prefix> prefix <fim_suffix> suffix <fim_middle>``; the answer is the middle, and it ends
at the end-of-sequence token or at one of the model's other file-level markers, which are added
to the request's stop tokens. The pieces are tokenized apart and joined by the markers' ids, so
marker text inside the user's code is never read as a marker.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specserve.sampling_params import SamplingParams

# (prefix, suffix, middle) marker names, then the tokens that end a middle, per tokenizer family
_STYLES = (
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
     ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>")),      # Qwen2.5-Coder
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|endoftext|>", "<fim_pad>", "<file_sep>")),   # StarCoder
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]


def _token_id(tokenizer, name: str) -> int | None:
    tid = tokenizer.convert_tokens_to_ids(name)
    return None if tid is None or tid == tokenizer.unk_token_id else tid


def fim_tokens(tokenizer) -> FimTokens | None:
    """The model's fill-in-the-middle markers, or None where its tokenizer has none."""
    for (pre, suf, mid), ends in _STYLES:
        ids = [_token_id(tokenizer, n) for n in (pre, suf, mid)]
        if None not in ids:
            end_ids = tuple(t for t in (_token_id(tokenizer, n) for n in ends) if t is not None)
            return FimTokens(*ids, ends=end_ids)
    return None


def fim_prompt(tokenizer, prefix: str, suffix: str) -> list[int]:
    """The prompt's token ids; ValueError where the model has no fill-in-the-middle markers."""
    marks = fim_tokens(tokenizer)
    if marks is None:
        raise ValueError("this model's tokenizer has no fill-in-the-middle tokens (<|fim_prefix|> or <fim_prefix>): "
                         "suffix needs a code model trained on fill-in-the-middle, such as Qwen2.5-Coder")
    def encode(text: str) -> list[int]:   # special-token text in the user's code stays text
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []

    return [marks.prefix, *encode(prefix), marks.suffix, *encode(suffix), marks.middle]


def fim_params(tokenizer, params: SamplingParams) -> SamplingParams:
    """``params`` with the model's end-of-middle tokens among its stop tokens."""
    marks = fim_tokens(tokenizer)
    ends = [t for t in (marks.ends if marks else ()) if t not in params.stop_token_ids]
    return dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids) + ends) if ends else params
