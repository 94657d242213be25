"""Scheduled batch -> flat tensors -> one forward -> logits at the asked positions.

One ``ModelRunner`` owns one model and its paged KV cache. The target and a
draft model each have their own runner (and their own attention metadata), so
both live in one process without shared global state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.distributed.parallel_state import SINGLE, TensorParallelGroup
from specserve.model_executor.layers.attention import (
    AttentionMetadata,
    copy_cache_slots,
    kv_cache_dtype_for,
    kv_cache_shape,
    tree_layout,
)
from specserve.model_executor.layers.fp16_gemm import compute_dtype_for, round_to_weight_dtype
from specserve.model_executor.layers.quantized import pack_for_tiles
from specserve.model_executor.loader import release_mapped_pages, release_pages_of
from specserve.model_executor.models.decoder import DecoderForCausalLM
from specserve.model_executor.models.registry import get_model_class
from specserve.worker.cuda_graphs import StepGraphs, graphs_possible


@dataclass
class ForwardInput:
    """One request's share of a step."""

    token_ids: list[int]       # the new tokens to compute (prefill chunk, last token, drafts)
    start_position: int        # position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]
    num_logits: int            # logits wanted at the last num_logits new tokens (0 = none)
    # A tree of drafts: tree_parents[i] is the index in token_ids of token i's parent (-1: the
    # last cached token). Token i's K/V still fills slot start_position + i, but it sits at
    # position start_position + depth and attends to its ancestors only. None = a chain.
    tree_parents: list[int] | None = None
    # A tree grown over several forwards (a draft's): the first tree_cached entries of
    # tree_parents are nodes already in the cache, in slots start_position - tree_cached ..
    # start_position - 1; tree_parents then covers them and token_ids (indices count from the
    # tree's first slot), and every position is that slot + depth.
    tree_cached: int = 0
    lora_id: int = 0           # the request's LoRA adapter (0: none; ModelRunner.add_lora)


@dataclass
class ForwardOutput:
    logits: torch.Tensor       # [sum num_logits, vocab] fp32
    hidden: torch.Tensor       # [sum num_logits, hidden] final-norm hidden states at the same positions
    all_hidden: torch.Tensor | None = None  # [sum len(token_ids), hidden] every new token's (when asked)


class ModelRunner:
    def __init__(
        self,
        config,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        block_size: int,
        tp: TensorParallelGroup = SINGLE,
    ):
        """``dtype`` is the weights' dtype; activations use ``self.dtype`` (float32 for
        float16 weights on a CPU, see fp16_gemm) and the KV cache ``self.kv_cache_dtype``
        (see ``kv_cache_dtype_for``)."""
        self.config = config
        self.weight_dtype = dtype
        self.dtype = compute_dtype_for(dtype, device)
        self.kv_cache_dtype = kv_cache_dtype_for(dtype, self.dtype, device)
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        model_cls = get_model_class(config)
        # Parameters are created empty (no init cost) and replaced by the checkpoint's
        # tensors, already in ``dtype``; rotary tables stay fp32.
        model = model_cls(config, tp=tp, max_positions=max_model_len)
        self.load_weights(model, state_dict)
        self.model = model.to(device).eval()
        round_to_weight_dtype(self.model, self.weight_dtype, self.dtype, device)
        if torch.device(device).type == "cpu" and pack_for_tiles(self.model, release=_PageReleaser()):
            release_mapped_pages()   # AMX tile order, on CPUs with AMX: the file's pages are no longer read
        if torch.device(device).type == "cpu" and hasattr(self.model, "use_cpu_layer_kernels"):
            self.model.use_cpu_layer_kernels()   # quantized GGUF weights: two compiled calls per layer
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.padding_block: int | None = None   # a block past num_blocks that captured graphs' padding writes
        self.graphs: StepGraphs | None = None   # decode and verification steps as CUDA graphs (use_graphs)

    def enable_lora(self) -> None:
        """Let requests run with LoRA adapters (``add_lora``; ``ForwardInput.lora_id``)."""
        self.model.enable_lora()

    def add_lora(self, adapter_id: int, modules: dict) -> None:
        """An adapter's full matrices (``lora.peft_adapter.LoraAdapter.modules``) under ``adapter_id``."""
        self.model.add_lora(adapter_id, modules, self.dtype)

    def remove_lora(self, adapter_id: int) -> None:
        self.model.remove_lora(adapter_id)

    def load_weights(self, model, state_dict: dict[str, torch.Tensor]) -> None:
        """Full (unsharded) checkpoint tensors; each layer keeps its shard.

        A tensor-parallel worker overrides this: its weights arrive already sharded.
        """
        model.load_weights({name: t.to(self.dtype) for name, t in state_dict.items()})

    @property
    def bytes_per_block(self) -> int:
        m = self.model
        per_layer = 2 * self.block_size * m.num_kv_heads_local * m.head_dim * torch.finfo(self.kv_cache_dtype).bits // 8
        return per_layer * len(m.layers)

    def allocate_kv_cache(self, num_blocks: int, padding_block: bool = False) -> None:
        """``num_blocks`` blocks for the KV cache manager to hand out; with ``padding_block`` one
        more (``self.padding_block``), which only the padding rows of captured graphs write."""
        m = self.model
        shape = kv_cache_shape(num_blocks + int(padding_block), self.block_size, m.num_kv_heads_local, m.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in m.layers]
        self.num_blocks = num_blocks
        self.padding_block = num_blocks if padding_block else None

    def can_use_graphs(self) -> bool:
        """Whether steps can replay as graphs: a decoder on CUDA (or, in the tests, a CPU with
        ``SPECSERVE_GRAPHS_ON_CPU=1``) whose attention is the Triton kernel."""
        return isinstance(self.model, DecoderForCausalLM) and graphs_possible(self.device, self.dtype,
                                                                               self.kv_cache_dtype)

    def use_graphs(self, max_num_reqs: int, max_query_len: int, max_tree_span: int, max_chain_steps: int = 0) -> None:
        """Replay decode and verification steps of up to ``max_num_reqs`` requests and
        ``max_query_len`` rows each (and greedy chains of up to ``max_chain_steps`` decode steps)
        as CUDA graphs (``cuda_graphs``); the cache must have its padding block. On a CPU (tests)
        the same padded forward runs eagerly."""
        assert self.padding_block is not None, "allocate_kv_cache(padding_block=True) first"
        self.graphs = StepGraphs(self, max_num_reqs, max_query_len, max_tree_span,
                                 capture=torch.device(self.device).type == "cuda", max_chain_steps=max_chain_steps)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Every row ``execute`` returns in ``all_hidden`` carries, after the final hidden state,
        the residual stream before these layers (an EAGLE-3 head's features). Set before the KV
        cache is allocated, so CUDA graphs capture the wider output."""
        self.model.set_feature_layers(layers)

    @torch.inference_mode()
    def copy_kv_slots(self, src: list[int], dst: list[int]) -> None:
        """K/V of cache slot src[i] -> slot dst[i], in every layer (all sources read first).

        After a tree of drafts is verified, the accepted branch's tokens may sit in
        slots further along than their positions; this moves them where the next step
        expects them (a chain never needs it). A forked beam gets its copies of its
        parent's partial block this way too (``engine/beam_groups.py``).
        """
        copy_cache_slots(self.kv_caches, src, dst)

    @torch.inference_mode()
    def execute(self, inputs: list[ForwardInput], return_all_hidden: bool = False) -> ForwardOutput:
        uses_lora = any(i.lora_id for i in inputs)   # such steps run eagerly (the graphs hold no adapters)
        bucket = self.graphs.bucket_for(inputs) if self.graphs is not None and not uses_lora else None
        width = self.model.config.hidden_size      # the rows' first columns; then any feature layers' (EAGLE-3)
        if bucket is not None:
            rows, logit_rows, token_rows = self.graphs.run(bucket, inputs)    # [bucket rows, hidden (+ features)]
            hidden = rows[torch.tensor(logit_rows, dtype=torch.long).to(self.device, non_blocking=True), :width]
            all_hidden = None
            if return_all_hidden:
                all_hidden = rows[torch.tensor(token_rows, dtype=torch.long).to(self.device, non_blocking=True)]
            return ForwardOutput(logits=self.model.compute_logits(hidden), hidden=hidden, all_hidden=all_hidden)
        token_ids: list[int] = []
        positions: list[int] = []
        logit_indices: list[int] = []
        tree_masks: list[list[int] | None] | None = None
        tree_back: list[int] = [0] * len(inputs)
        for b, inp in enumerate(inputs):
            first = len(token_ids)
            n = len(inp.token_ids)
            token_ids.extend(inp.token_ids)
            if inp.tree_parents is None:
                positions.extend(range(inp.start_position, inp.start_position + n))
            else:
                depths, masks = tree_layout(inp.tree_parents)
                assert len(depths) == inp.tree_cached + n, "tree_parents covers the cached nodes and the new"
                tree_start = inp.start_position - inp.tree_cached
                positions.extend(tree_start + d for d in depths[inp.tree_cached:])
                tree_masks = tree_masks or [None] * len(inputs)
                tree_masks[b] = masks[inp.tree_cached:]
                tree_back[b] = inp.tree_cached
            logit_indices.extend(range(first + n - inp.num_logits, first + n))
        if positions and max(positions) >= self.max_model_len:
            raise ValueError(f"position {max(positions)} beyond max_model_len ({self.max_model_len})")
        meta = AttentionMetadata.build(
            query_lens=[len(i.token_ids) for i in inputs],
            context_lens=[i.start_position + len(i.token_ids) for i in inputs],
            block_tables=[i.block_table for i in inputs],
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
            cache_dtype=self.kv_cache_dtype,
            tree_masks=tree_masks,
            tree_back=tree_back,
        )
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        if uses_lora:
            if getattr(self.model, "lora_rows", None) is None:
                raise ValueError("a forward input names a LoRA adapter but this runner has LoRA off (enable_lora)")
            self.model.lora_rows.set([i.lora_id for i in inputs for _ in i.token_ids], self.device)
        try:
            all_hidden = self.model(ids, pos, self.kv_caches, meta)  # [T, hidden (+ features)]
        finally:
            if uses_lora:
                self.model.lora_rows.clear()
        idx = torch.tensor(logit_indices, dtype=torch.long).to(self.device, non_blocking=True)
        hidden = all_hidden[idx, :width]
        return ForwardOutput(
            logits=self.model.compute_logits(hidden),
            hidden=hidden,
            all_hidden=all_hidden if return_all_hidden else None,
        )


def allocate_kv_cache(runner, num_blocks: int, graphs: bool, max_num_reqs: int, max_query_len: int,
                      max_tree_span: int, max_chain_steps: int = 0) -> bool:
    """A target's or draft's KV cache of ``num_blocks`` blocks and, where ``graphs`` is asked for
    and the runner can (``ModelRunner.can_use_graphs``; a TensorParallelExecutor cannot), CUDA
    graphs for its steps of up to ``max_num_reqs`` requests x ``max_query_len`` rows (trees up to
    ``max_tree_span`` slots; a draft's greedy chains up to ``max_chain_steps`` steps). Returns
    whether its steps replay as graphs."""
    graphs = graphs and isinstance(runner, ModelRunner) and runner.can_use_graphs()
    runner.allocate_kv_cache(num_blocks, **({"padding_block": True} if graphs else {}))
    if graphs:
        runner.use_graphs(max_num_reqs, max_query_len, max_tree_span, max_chain_steps)
    return graphs


class _PageReleaser:
    """pack_for_tiles' ``release``: keeps loading's peak memory near the repacked model's size.
    Its first call drops every mapped GGUF page (loading read the whole file: fused matrices are
    copies), each later one the pages of the slice just packed (read again while packing)."""

    def __init__(self) -> None:
        self.first = True

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        if self.first:
            release_mapped_pages()
            self.first = False
        else:
            release_pages_of(tensors)
