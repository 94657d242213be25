"""Per-token provenance for the ``"specserve": {"provenance": true}`` extension.

Each choice then carries ``"specserve": {"tokens": [{"id", "text", "source"}, ...]}``
(in a stream: the tokens new in that chunk) and, once it finishes, ``"stats"``:
the request's speculation counts (``SpecDecodeStats.as_dict``). ``source`` is one
of ``outputs.TOKEN_SOURCES``. Responses without the extension are unchanged.
"""
from __future__ import annotations

from specserve.outputs import CompletionOutput

# Tokens decoded before the one whose text piece is wanted: enough for a UTF-8
# character split over several byte tokens and for tokenizers whose decoding of a
# token depends on its neighbour (leading spaces), few enough to stay cheap.
_CONTEXT_TOKENS = 6


def token_pieces(tokenizer, token_ids: list[int], start: int, end: int, skip_special_tokens: bool = True) -> list[str]:
    """The text each of ``token_ids[start:end]`` adds to the decoded output.

    A token that ends inside a multi-byte character adds "" and the token that
    completes it adds the whole character, so the pieces concatenate to the text."""
    pieces = []
    for i in range(start, end):
        window = token_ids[max(0, i - _CONTEXT_TOKENS) : i]
        before = tokenizer.decode(window, skip_special_tokens=skip_special_tokens).rstrip("\ufffd")
        after = tokenizer.decode(window + [token_ids[i]], skip_special_tokens=skip_special_tokens)
        pieces.append("" if after.endswith("\ufffd") else after[len(before):])
    return pieces


def token_entries(tokenizer, completion: CompletionOutput, start: int, end: int, skip_special_tokens: bool = True) -> list[dict]:
    """``[{"id", "text", "source"}]`` for the completion's tokens ``start:end``."""
    ids = completion.token_ids
    pieces = token_pieces(tokenizer, ids, start, end, skip_special_tokens)
    return [{"id": ids[i], "text": piece, "source": completion.token_sources[i]}
            for i, piece in zip(range(start, end), pieces)]


def choice_extension(tokens: list[dict], finished: CompletionOutput | None = None) -> dict:
    """A choice's ``specserve`` object: its tokens, plus its stats when ``finished``
    (the choice's completion, once it ended) is given."""
    ext: dict = {"tokens": tokens}
    if finished is not None and finished.spec_decode_stats is not None:
        ext["stats"] = finished.spec_decode_stats.as_dict()
    return ext
