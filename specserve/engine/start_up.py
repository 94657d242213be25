"""What the engine works out once, at start-up: its device, its context length, how many KV
blocks fit, and the ``ProposerContext`` its proposer is built from."""
from __future__ import annotations

import logging

import torch

from specserve.config import EngineConfig
from specserve.core.kv_cache_manager import KVCacheManager
from specserve.spec_decode.context import ProposerContext

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def max_model_len_for(config: EngineConfig, hf_config) -> int:
    """The user's max_model_len (checked against the model's limit), else the limit capped at 8192."""
    model_limit = getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
    if config.max_model_len is not None and config.max_model_len > model_limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {model_limit} positions")
    return config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)


def kv_cache_blocks(config: EngineConfig, bytes_per_block: int, max_model_len: int, k: int) -> int:
    """How many KV blocks ``kv_cache_memory`` holds; at least one longest request's worth."""
    num_blocks = config.kv_cache_memory // bytes_per_block
    needed = -(-(max_model_len + k) // config.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory} bytes holds {num_blocks} blocks of {config.block_size} "
            f"tokens, fewer than one request of max_model_len={max_model_len} (+{k} lookahead) needs "
            f"({needed}); raise kv_cache_memory or lower max_model_len"
        )
    return num_blocks


def prefix_caching_allowed(config: EngineConfig, proposer) -> bool:
    """Prefix caching as asked, except with a given proposer that needs the target's hidden state
    at every position and keeps no K/V in the cached blocks (training's recorder): a cached prefix
    has none. (A proposer's K/V rides in the cached blocks as its ``cached_kv`` says.)"""
    if config.enable_prefix_caching and proposer is not None and proposer.needs_target_hidden \
            and proposer.cached_kv is None:
        logger.info("prefix caching is off: the proposer needs the target's hidden state at every position")
        return False
    return config.enable_prefix_caching


def proposer_context(config: EngineConfig, runner, dtype: torch.dtype, hf_config, max_model_len: int,
                     kv_cache: KVCacheManager, tokenizer=None) -> ProposerContext:
    """``runner``: the target's ModelRunner, or its TensorParallelExecutor at TP > 1; ``tokenizer``:
    the target's."""
    tp = config.tensor_parallel_size
    model = runner.model if tp == 1 else None   # at TP > 1 the embedding and LM head are sharded over ranks
    lm_head = None
    if model is not None:
        head = model.lm_head
        lm_head = next(m for m in (head.quantized_file_order, head.quantized, head.weight) if m is not None)
    return ProposerContext(
        device=runner.device,
        dtype=dtype,
        dtype_setting=config.dtype,
        max_model_len=max_model_len,
        target_vocab_size=hf_config.vocab_size,
        target_hidden_size=hf_config.hidden_size,
        target_num_layers=hf_config.num_hidden_layers,
        kv_cache=kv_cache,
        block_size=config.block_size,
        tensor_parallel_size=tp,
        tp_group=runner if tp > 1 else None,
        target_embed_tokens=model.embed_tokens if model is not None else None,
        target_lm_head_weight=lm_head,
        target_tokenizer=tokenizer,
        graphs=not config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
    )
