"""SpeculativeConfig + the target's ProposerContext -> a Proposer (checks: ``checks.py``)."""
from __future__ import annotations

import dataclasses
import logging
import time

from tqdm import tqdm

from specserve.config import DEFAULT_SPECULATIVE_TOKENS, SpeculativeConfig
from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.quantized import REQUANTIZE_FORMATS
from specserve.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from specserve.model_executor.loader import keeps_quantized, load_model, resolve_dtype
from specserve.spec_decode.checks import VocabularyMismatchError, check_draft_config, check_vocab  # noqa: F401 - re-exported
from specserve.spec_decode.context import ProposerContext
from specserve.spec_decode.draft_model import DraftModelProposer
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.proposer import Proposer
from specserve.worker.model_runner import allocate_kv_cache
from specserve.worker.tp_executor import build_draft_runner

logger = logging.getLogger(__name__)

# k of method "grammar" when none is given: a schema's forced runs (a key with its quotes and
# colon, a closing brace and the next key) are often longer than DEFAULT_SPECULATIVE_TOKENS.
GRAMMAR_SPECULATIVE_TOKENS = 8


def resolve_speculative_config(spec: SpeculativeConfig, target_model: str | None) -> SpeculativeConfig:
    """Fill in what the user left to specserve: the shipped draft and k.

    No draft named (draft_model or eagle): the one shipped for the default target
    (a clear error for other targets). No k: an EAGLE head's recommended k from
    its eagle_config.json; suffix decoding's tree depth (its trees hold at most k
    tokens, and dynamic_k trims them to what pays); else DEFAULT_SPECULATIVE_TOKENS.
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
        elif spec.method == "suffix":
            k = spec.suffix_max_depth
        elif spec.method == "grammar":
            k = GRAMMAR_SPECULATIVE_TOKENS
        spec = dataclasses.replace(spec, num_speculative_tokens=k or DEFAULT_SPECULATIVE_TOKENS)
    return spec


def build_proposer(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer | None:
    """``spec`` as returned by ``resolve_speculative_config``; None for method "grammar", whose
    only drafts are the grammar's forced tokens (engine/constraints.py)."""
    if spec.method == "grammar":
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.prompt_lookup_adaptive,
                             spec.prompt_lookup_tree)
    if spec.method == "suffix":
        from specserve.spec_decode.suffix import SuffixProposer

        return SuffixProposer(spec.suffix_max_depth, spec.suffix_min_token_prob, spec.suffix_max_cached_requests,
                              spec.suffix_max_spec_factor)
    if spec.method == "eagle":
        from specserve.spec_decode.eagle import build_eagle_proposer

        return build_eagle_proposer(spec, ctx)
    if spec.method == "draft_model":
        return build_draft_model_proposer(spec, ctx)
    raise ValueError(f"speculative method {spec.method!r} is not available yet")


def draft_model_at_tp1(runner, option: str):
    """The draft's model, for an option that rewrites its weights in the driver process (TP 1)."""
    model = getattr(runner, "model", None)
    if model is None or model.tp.world_size != 1:
        raise ValueError(f"{option} needs the draft at tensor-parallel size 1")
    return model


def requantize_draft(runner, name: str) -> None:
    """Every quantized matmul of the draft (its layers and LM head) in format ``name``
    (``SpeculativeConfig.draft_quantization``), then its compiled layer kernels rebuilt on
    the new blocks. TP 1 only; the draft must hold GGUF blocks (a .gguf file, dtype auto)."""
    model = draft_model_at_tp1(runner, "draft_quantization")
    linears = [m for m in model.modules() if getattr(m, "quantized", None) is not None
               and (isinstance(m, ParallelLMHead) or not isinstance(m, VocabParallelEmbedding))]   # not the lookup
    if not linears:
        raise ValueError("draft_quantization needs a GGUF draft kept in its blocks (a .gguf file, "
                         "dtype auto on a CPU)")
    qtype = REQUANTIZE_FORMATS[name]
    start = time.perf_counter()
    for m in tqdm(linears, desc=f"requantizing the draft to {name}", unit="matrix", leave=False):
        m.quantized = m.quantized.requantize(qtype)
    if model.layer_kernels is not None:   # they point at the old blocks
        model.use_cpu_layer_kernels()
    logger.info("draft requantized to %s in %.1f s", name, time.perf_counter() - start)


def draft_uses_int8_activations(setting: bool | None) -> bool:
    """The draft's activations: as set, else (None) int8, which multiplies fastest wherever specserve
    has int8 kernels (the draft only guesses: its numbers never change the output): VNNI or AVX2
    without AMX, AMX int8 tiles with it, as fast at one row as float32 on the bfloat16 tiles and
    faster at several (docs/real_models.md). Float32 only on an AMX CPU whose build lacks the int8
    tiles, where the bfloat16 tiles beat the VNNI kernel at several rows."""
    if setting is not None:
        return setting
    return not quant_gemm.amx_tiles_available() or quant_gemm.amx_int8_tiles_available()


def build_draft_model_proposer(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    """A draft model: ``DraftModelProposer`` with the target's vocabulary, else (the start-up check
    found another tokenizer, or ``cross_vocab`` names a method) ``CrossVocabProposer``."""
    dtype = resolve_dtype(spec.draft_dtype, ctx.device) if spec.draft_dtype else ctx.dtype
    fit = check_draft_config(spec.model, ctx.target_vocab_size, ctx.max_model_len, dtype, ctx.target_tokenizer,
                             spec.cross_vocab)
    if fit.mapping is not None and (spec.draft_tensor_parallel_size or 1) > 1:
        raise ValueError("a draft with another vocabulary runs at draft_tensor_parallel_size 1")
    keep = keeps_quantized(spec.draft_dtype or ctx.dtype_setting, ctx.device)
    int8 = draft_uses_int8_activations(spec.draft_int8_activations)
    loaded = load_model(spec.model, dtype, keep_quantized=keep, int8_activations=int8)
    # TP 1: in the driver process only; draft_tensor_parallel_size = the target's TP: sharded like it.
    sharded_like_target = (spec.draft_tensor_parallel_size or 1) > 1 and ctx.tp_group is not None
    runner = build_draft_runner(loaded, dtype, ctx.device, ctx.max_model_len, ctx.block_size,
                                ctx.tp_group if sharded_like_target else None)
    if spec.draft_vocab_size is not None:
        draft_model_at_tp1(runner, "draft_vocab_size").lm_head.keep_first_tokens(spec.draft_vocab_size)
    if spec.draft_quantization is not None:
        requantize_draft(runner, spec.draft_quantization)
    lookahead = spec.num_lookahead_slots
    allocate_kv_cache(runner, ctx.kv_cache.num_blocks, ctx.graphs, ctx.max_num_seqs, max_query_len=lookahead + 1,
                      max_tree_span=lookahead + 1 if spec.tree is not None else 0,
                      max_chain_steps=lookahead - 1 if spec.tree is None and fit.mapping is None else 0)
    if fit.mapping is not None:
        from specserve.spec_decode.cross_vocab import DEFAULT_METHOD, CrossVocabProposer

        proposer = CrossVocabProposer(runner, fit.mapping, spec.cross_vocab or DEFAULT_METHOD, ctx.target_tokenizer,
                                      fit.meta.tokenizer, ctx.kv_cache.num_blocks, ctx.block_size, ctx.max_model_len)
        model = getattr(runner, "model", None)      # the draft in this process, at TP 1 (the rule for such drafts)
        if model is not None and model.tp.world_size == 1:
            proposer.compute_shared_rows_only(model.lm_head)
        return proposer
    return DraftModelProposer(runner, ctx.kv_cache, ctx.target_vocab_size, spec.tree, spec.num_speculative_tokens)
