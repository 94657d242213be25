"""SpeculativeConfig -> a Proposer, with the start-up checks (vocabulary, context)."""
from __future__ import annotations

import dataclasses

from specserve.config import DEFAULT_SPECULATIVE_TOKENS, SpeculativeConfig
from specserve.model_executor.loader import keeps_quantized, load_model, resolve_dtype
from specserve.spec_decode.draft_model import DraftModelProposer
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.proposer import Proposer
from specserve.worker.model_runner import ModelRunner
from specserve.worker.tp_executor import build_draft_runner


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


def resolve_speculative_config(spec: SpeculativeConfig, target_model: str | None) -> SpeculativeConfig:
    """Fill in what the user left to specserve: the shipped draft and k.

    No draft named (draft_model or eagle): the one shipped for the default target
    (a clear error for other targets). No k: an EAGLE head's recommended k from
    its eagle_config.json, else DEFAULT_SPECULATIVE_TOKENS.
    """
    if spec.method in ("draft_model", "eagle") and spec.model is None:
        from specserve.drafts import shipped_draft

        spec = dataclasses.replace(spec, model=shipped_draft(spec.method, target_model))
    if spec.num_speculative_tokens is None:
        k = None
        if spec.method == "eagle":
            from specserve.model_executor.models.eagle import EagleConfig, is_eagle_folder

            if is_eagle_folder(spec.model):
                k = EagleConfig.load(spec.model).num_speculative_tokens
        spec = dataclasses.replace(spec, num_speculative_tokens=k or DEFAULT_SPECULATIVE_TOKENS)
    return spec


def build_proposer(spec: SpeculativeConfig, engine, target_vocab: int) -> Proposer:
    """``spec`` as returned by ``resolve_speculative_config``."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.prompt_lookup_adaptive,
                             spec.prompt_lookup_tree)
    if spec.method == "suffix":
        from specserve.spec_decode.suffix import SuffixProposer

        return SuffixProposer(spec.suffix_max_depth, spec.suffix_min_token_prob, spec.suffix_max_cached_requests,
                              spec.suffix_max_spec_factor)
    if spec.method == "eagle":
        from specserve.spec_decode.eagle import build_eagle_proposer

        return build_eagle_proposer(spec, engine, target_vocab)
    if spec.method == "draft_model":
        dtype = resolve_dtype(spec.draft_dtype, engine.device) if spec.draft_dtype else engine.dtype
        check_draft_config(spec.model, target_vocab, engine.max_model_len, dtype)
        keep = keeps_quantized(spec.draft_dtype or engine.config.dtype, engine.device)
        int8 = spec.draft_int8_activations is not False   # None: on (the draft only guesses)
        loaded = load_model(spec.model, dtype, keep_quantized=keep, int8_activations=int8)
        # TP 1: in the driver process only; draft_tensor_parallel_size = the target's TP: sharded like it.
        runner = build_draft_runner(spec, engine, loaded, dtype)
        if spec.draft_vocab_size is not None:
            if not hasattr(runner, "model") or runner.model.tp.world_size != 1:
                raise ValueError("draft_vocab_size needs the draft at tensor-parallel size 1")
            runner.model.lm_head.keep_first_tokens(spec.draft_vocab_size)
        runner.allocate_kv_cache(engine.kv_cache.num_blocks)
        return DraftModelProposer(runner, engine.kv_cache, target_vocab)
    raise ValueError(f"speculative method {spec.method!r} is not available yet")
