"""Start-up checks that a draft fits its target: the vocabulary and the context length.

They read the draft's config alone (no weights), so a mismatched draft is refused in
about a second instead of after its weight load.
"""
from __future__ import annotations

from specserve.model_executor.loader import load_model


class VocabularyMismatchError(ValueError):
    pass


def check_vocab(target_vocab: int, draft_vocab: int, draft_name: str) -> None:
    if target_vocab != draft_vocab:
        raise VocabularyMismatchError(
            f"the draft {draft_name!r} has a vocabulary of {draft_vocab} tokens but the target has "
            f"{target_vocab}; a draft must share the target's vocabulary"
        )


def check_draft_config(model: str, target_vocab: int, max_model_len: int, dtype) -> None:
    """Vocabulary and context checks on the draft's config alone, before its weights load.

    A mismatched draft is then found in about a second (a config and tokenizer read,
    cached after the first one) instead of after its weights (about 40 s for a 0.5B
    GGUF). The weight load that follows reads the config again: ~1 s more per start.
    """
    meta = load_model(model, dtype, load_weights=False)
    check_vocab(target_vocab, meta.config.vocab_size, meta.name)
    draft_limit = getattr(meta.config, "max_position_embeddings", max_model_len)
    if draft_limit < max_model_len:
        raise ValueError(
            f"the draft supports {draft_limit} positions, fewer than max_model_len={max_model_len}; "
            "lower max_model_len"
        )
