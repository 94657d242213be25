"""What a proposer may use of the target it drafts for: ``ProposerContext``.

The engine builds one at start-up and hands it to ``factory.build_proposer``;
proposers never see the engine itself, so ``spec_decode/`` imports only what
lies below it (``core/``, ``sample/``, ``worker/``, ``model_executor/``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specserve.core.kv_cache_manager import KVCacheManager


@dataclass(frozen=True)
class ProposerContext:
    device: torch.device
    dtype: torch.dtype                # the target's weight dtype: a draft's default
    dtype_setting: str                # the dtype the user asked for ("auto" keeps GGUF blocks on a CPU)
    max_model_len: int
    target_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    # The target's block tables: proposers with a KV cache of their own (draft model, EAGLE)
    # allocate ``kv_cache.num_blocks`` blocks of ``block_size`` tokens and index them with these.
    kv_cache: KVCacheManager
    block_size: int
    tensor_parallel_size: int
    # At tensor_parallel_size > 1: the target's TensorParallelExecutor, whose ranks also take a
    # draft sharded like the target (``add_model``); None at TP 1.
    tp_group: Any = None
    # The target's input embedding and LM head rows (a tensor or a QuantizedMatrix), for
    # proposers that reuse them (EAGLE); None where they are not in this process (TP > 1).
    target_embed_tokens: torch.nn.Module | None = None
    target_lm_head_weight: Any = None
    # The target's tokenizer: a draft with another vocabulary is mapped onto it (``vocab_map``).
    target_tokenizer: Any = None
    # CUDA graphs for a draft model's steps (EngineConfig.enforce_eager off), sized to the batch.
    graphs: bool = False
    max_num_seqs: int = 1
