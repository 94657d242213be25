"""Fill in the middle: what goes between a prefix and a suffix, for code models trained on it
(Qwen2.5-Coder, StarCoder-style tokenizers). The OpenAI API asks for it with ``suffix`` on
/v1/completions (``specserve generate --suffix``).

The prompt is the prefix-suffix-middle order these models learned:
``<fim_prefix> prefix <fim_suffix> suffix <fim_middle>``; the answer is the middle, and it ends
at the end-of-sequence token or at one of the model's other file-level markers, which are added
to the request's stop tokens. The pieces are tokenized apart and joined by the markers' ids, so
marker text inside the user's code is never read as a marker. llama-server's ``/infill``
(``infill_prompt``) adds context files before the prefix, written as a repository where the
model has the markers for one, as llama.cpp writes them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specserve.sampling_params import SamplingParams

# (prefix, suffix, middle) marker names, the tokens that end a middle, and the repository-level
# markers (repository name, file separator), per tokenizer family
_STYLES = (
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
     ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>"),
     ("<|repo_name|>", "<|file_sep|>")),                                                     # Qwen2.5-Coder
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|endoftext|>", "<fim_pad>", "<file_sep>"),
     ("<reponame>", "<file_sep>")),                                                          # StarCoder
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]
    repo: int | None = None          # repository-level context: its name's marker, then files after
    file_sep: int | None = None      # the file separator


def _token_id(tokenizer, name: str) -> int | None:
    tid = tokenizer.convert_tokens_to_ids(name)
    return None if tid is None or tid == tokenizer.unk_token_id else tid


def fim_tokens(tokenizer) -> FimTokens | None:
    """The model's fill-in-the-middle markers, or None where its tokenizer has none."""
    for (pre, suf, mid), ends, (repo, sep) in _STYLES:
        ids = [_token_id(tokenizer, n) for n in (pre, suf, mid)]
        if None not in ids:
            end_ids = tuple(t for t in (_token_id(tokenizer, n) for n in ends) if t is not None)
            return FimTokens(*ids, ends=end_ids, repo=_token_id(tokenizer, repo), file_sep=_token_id(tokenizer, sep))
    return None


def fim_prompt(tokenizer, prefix: str, suffix: str) -> list[int]:
    """The prompt's token ids; ValueError where the model has no fill-in-the-middle markers."""
    marks = _marks(tokenizer)
    return [marks.prefix, *_encode(tokenizer, prefix), marks.suffix, *_encode(tokenizer, suffix), marks.middle]


def _marks(tokenizer) -> FimTokens:
    marks = fim_tokens(tokenizer)
    if marks is None:
        raise ValueError("this model's tokenizer has no fill-in-the-middle tokens (<|fim_prefix|> or <fim_prefix>): "
                         "suffix needs a code model trained on fill-in-the-middle, such as Qwen2.5-Coder")
    return marks


def _encode(tokenizer, text: str) -> list[int]:
    """``text``'s ids; special-token text in the user's code stays text."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


# How much of each part an infill prompt keeps (llama-server's split of its 2,048-token batch):
# the prefix's last 1,536 tokens, the suffix's first 512 less the middle's text and 2.
INFILL_BATCH = 2048


def infill_prompt(tokenizer, prefix: str, suffix: str, extra: list[tuple[str, str]], middle: str,
                  budget: int) -> list[int]:
    """llama-server's ``/infill`` prompt: context files (``extra``: (filename, text), least
    relevant first), then prefix, suffix and the middle's start (``middle``, the text after the
    middle marker), in at most ``budget`` tokens. With repository-level markers (Qwen2.5-Coder's
    ``<|repo_name|>`` and ``<|file_sep|>``) the files are written as a repository, else simply put
    first. The prefix keeps its end, the suffix its start; the files fill what is left, the
    earliest dropped first. ValueError where the model has no fill-in-the-middle markers."""
    marks = _marks(tokenizer)
    middle_ids = _encode(tokenizer, middle)
    prefix_ids = _encode(tokenizer, prefix)[-(3 * INFILL_BATCH // 4):]
    suffix_ids = _encode(tokenizer, suffix)[: max(0, INFILL_BATCH // 4 - (2 + len(middle_ids)))]
    core = [marks.prefix, *prefix_ids, marks.suffix, *suffix_ids, marks.middle, *middle_ids]
    repo = marks.repo is not None and marks.file_sep is not None
    context: list[int] = []
    if repo:
        context += [marks.repo, *_encode(tokenizer, "myproject\n")]
    for filename, text in extra:
        if repo:
            context += [marks.file_sep, *_encode(tokenizer, filename + "\n")]
        context += _encode(tokenizer, text)
    if repo:
        context += [marks.file_sep, *_encode(tokenizer, "filename\n")]
    room = max(0, budget - len(core))
    if len(context) > room:
        context = context[len(context) - room:] if room else []
    return context + core


def fim_params(tokenizer, params: SamplingParams) -> SamplingParams:
    """``params`` with the model's end-of-middle tokens among its stop tokens."""
    marks = fim_tokens(tokenizer)
    ends = [t for t in (marks.ends if marks else ()) if t not in params.stop_token_ids]
    return dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids) + ends) if ends else params
