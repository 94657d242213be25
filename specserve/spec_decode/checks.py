"""Start-up checks that a draft fits its target: the vocabulary and the context length.

They read the draft's config and tokenizer alone (no weights), so a mismatched draft is
refused in about a second instead of after its weight load. A draft whose vocabulary differs
from the target's is not refused: given the target's tokenizer, the check maps one
vocabulary onto the other (``vocab_map``) and selects the cross-vocabulary path
(``cross_vocab.py``), with a log line; only a draft that shares too little text with the
target is an error (``NoUsableOverlapError``, a ``VocabularyMismatchError``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from specserve.model_executor.loader import LoadedModel, load_model
from specserve.spec_decode.vocab_map import VocabMapping, VocabularyMismatchError, vocab_mapping

logger = logging.getLogger(__name__)

__all__ = ["DraftFit", "VocabularyMismatchError", "check_draft_config", "check_vocab", "same_tokenizer"]


@dataclass
class DraftFit:
    """What the checks found: the draft's config and tokenizer (no weights), and the vocabulary
    mapping when it drafts across vocabularies (None: it shares the target's)."""

    meta: LoadedModel
    mapping: VocabMapping | None = None


def check_vocab(target_vocab: int, draft_vocab: int, draft_name: str) -> None:
    if target_vocab != draft_vocab:
        raise VocabularyMismatchError(
            f"the draft {draft_name!r} has a vocabulary of {draft_vocab} tokens but the target has "
            f"{target_vocab}; a draft must share the target's vocabulary"
        )


def check_draft_config(model: str, target_vocab: int, max_model_len: int, dtype, target_tokenizer=None,
                       cross_vocab: str | None = None) -> DraftFit:
    """Vocabulary and context checks on the draft's config alone, before its weights load.

    A mismatched draft is then found in about a second (a config and tokenizer read,
    cached after the first one) instead of after its weights (about 40 s for a 0.5B
    GGUF). The weight load that follows reads the config again: ~1 s more per start.
    Without ``target_tokenizer`` the vocabularies must be the same size. With it, a draft
    whose tokenizer differs (or any draft, when ``cross_vocab`` names a method) gets the
    mapping between the two vocabularies.
    """
    meta = load_model(model, dtype, load_weights=False)
    draft_limit = getattr(meta.config, "max_position_embeddings", max_model_len)
    if draft_limit < max_model_len:
        raise ValueError(
            f"the draft supports {draft_limit} positions, fewer than max_model_len={max_model_len}; "
            "lower max_model_len"
        )
    draft_vocab = meta.config.vocab_size
    if target_tokenizer is None:
        check_vocab(target_vocab, draft_vocab, meta.name)
        return DraftFit(meta)
    if cross_vocab is None and draft_vocab == target_vocab and same_tokenizer(target_tokenizer, meta.tokenizer):
        return DraftFit(meta)
    mapping = vocab_mapping(target_tokenizer, target_vocab, meta.tokenizer, draft_vocab, meta.name)
    if cross_vocab is None and mapping.identical:
        return DraftFit(meta)
    logger.info("the draft %r %s: drafting across vocabularies (%d of its %d tokens have a twin in the target's "
                "%d)", meta.name,
                "shares the target's vocabulary, forced through the cross-vocabulary path" if mapping.identical
                else "has another tokenizer than the target", mapping.num_shared, draft_vocab, target_vocab)
    return DraftFit(meta, mapping)


def same_tokenizer(a, b) -> bool:
    """The same tokenizer, or one serialized alike (its vocabulary, merges and settings)."""
    if a is b:
        return True
    backend_a, backend_b = getattr(a, "backend_tokenizer", None), getattr(b, "backend_tokenizer", None)
    if backend_a is None or backend_b is None:
        return False
    return (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id) and \
        backend_a.to_str() == backend_b.to_str()
