"""The Llama family (Llama, SmolLM2, Mistral, Qwen2 with its qkv bias) in one file.

Weights arrive in Hugging Face naming through ``load_weights``; q/k/v and
gate/up are fused into one matmul each (fewer kernel launches per token).
With GGUF-quantized weights on a CPU, each layer's norms, matmuls, rotary,
activation and residual adds run as two compiled calls around attention
(``quant_layer``; ``use_cpu_layer_kernels``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import SINGLE, TensorParallelGroup
from specserve.model_executor.layers.attention import AttentionMetadata, paged_attention
from specserve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from specserve.model_executor.layers.norm import RMSNorm
from specserve.model_executor.layers.quant_layer import QuantizedLayerKernel, QuantizedLayerStack
from specserve.model_executor.layers.rotary import RotaryEmbedding, apply_rotary, rope_theta_of
from specserve.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup):
        super().__init__()
        hidden = config.hidden_size
        self.total_heads = config.num_attention_heads
        self.total_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.total_heads
        if self.total_heads % self.total_kv_heads:
            raise ValueError(f"num_attention_heads ({self.total_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.total_kv_heads})")
        # Ranks hold whole KV heads with their query heads (3 KV heads on 2 ranks: 2 + 1).
        kv_groups = self.total_kv_heads
        _, self.num_heads = tp.shard(self.total_heads, "num_attention_heads", kv_groups)
        _, self.num_kv_heads = tp.shard(self.total_kv_heads, "num_key_value_heads", kv_groups)
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = ColumnParallelLinear(
            hidden,
            [self.total_heads * self.head_dim, self.total_kv_heads * self.head_dim, self.total_kv_heads * self.head_dim],
            bias=bias,
            tp=tp,
            num_units=kv_groups,
        )
        self.o_proj = RowParallelLinear(self.total_heads * self.head_dim, hidden, bias=False, tp=tp, num_units=kv_groups)
        self.scale = self.head_dim**-0.5

    def forward(self, rope, x, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hk) * hd]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
        # q and k are adjacent in the fused output: rotate both in one go.
        qk = apply_rotary(qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        out = self.attend(qk, v, kv_cache, meta)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def attend(self, qk: torch.Tensor, v: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """qk [T, Hq + Hk, hd] rotated, v [T, Hk * hd] -> attention output [T, Hq, hd] (K/V cached)."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return paged_attention(q, k, v, kv_cache, meta, self.scale)


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], bias=False, tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, tp=tp)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, rope, x, kv_cache, meta):
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup = SINGLE, max_positions: int = 8192):
        super().__init__()
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        first = self.layers[0].self_attn
        self.num_kv_heads_local = first.num_kv_heads
        self.head_dim = first.head_dim
        self.rotary = RotaryEmbedding(self.head_dim, max_positions, rope_theta_of(config))
        self.layer_kernels: list[QuantizedLayerKernel] | None = None   # set by use_cpu_layer_kernels
        self.layer_stack: QuantizedLayerStack | None = None            # ... and all of them in one call

    def use_cpu_layer_kernels(self) -> bool:
        """Run every layer through ``quant_layer``'s two compiled calls when all of them can
        (quantized weights, TP 1, CPU, kernel built); returns whether they do."""
        kernels = [QuantizedLayerKernel.for_layer(layer, layer.input_layernorm.eps, self.tp.world_size)
                   for layer in self.layers]
        self.layer_kernels = kernels if kernels and all(k is not None for k in kernels) else None
        self.layer_stack = QuantizedLayerStack.build(kernels) if self.layer_kernels is not None else None
        return self.layer_kernels is not None

    def forward(
        self,
        input_ids: torch.Tensor,   # [T]
        positions: torch.Tensor,   # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, Hk, num_blocks, block_size, hd]
        meta: AttentionMetadata,
    ) -> torch.Tensor:             # [T, hidden] after the final norm
        x = self.embed_tokens(input_ids)
        if self.layer_kernels is not None and x.device.type == "cpu":
            return self.norm(self._forward_layer_kernels(x, positions, kv_caches, meta))
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(rope, x, kv_cache, meta)
        return self.norm(x)

    def _forward_layer_kernels(self, x, positions, kv_caches, meta) -> torch.Tensor:
        """The layers as quant_layer's compiled halves around attention; x [T, hidden] float32."""
        if positions.numel() and int(positions.max()) >= self.rotary.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} beyond the rotary table ({self.rotary.cos.shape[0]})")
        x = x.float().contiguous()
        positions = positions.to(torch.int64).contiguous()
        tokens = x.shape[0]
        scratch = torch.empty_like(x)                                              # [T, hidden]
        gate_up = torch.empty(tokens, 2 * self.config.intermediate_size)   # [T, 2 I] (TP 1 only)
        if self.layer_stack is not None and meta.kernel is not None:
            # every layer, attention included, in one call
            self.layer_stack.run(x, positions, self.rotary.cos, self.rotary.sin, kv_caches, meta,
                                 self.layers[0].self_attn.scale, scratch, gate_up)
            return x
        for layer, kernel, kv_cache in zip(self.layers, self.layer_kernels, kv_caches):
            attn = layer.self_attn
            qkv = kernel.attn_in(x, positions, self.rotary.cos, self.rotary.sin, scratch)   # [T, (Hq + 2 Hk) hd]
            qk, v = qkv.split([(attn.num_heads + attn.num_kv_heads) * attn.head_dim, attn.num_kv_heads * attn.head_dim],
                              dim=-1)
            out = attn.attend(qk.view(tokens, -1, attn.head_dim), v, kv_cache, meta)     # [T, Hq, hd]
            kernel.mlp(x, out.reshape(tokens, -1), scratch, gate_up)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) Hugging Face tensors; each layer keeps its shard."""
        sd = dict(state_dict)
        self.embed_tokens.load(sd.pop("model.embed_tokens.weight"))
        lm_head = sd.pop("lm_head.weight", None)  # absent when tied to the embeddings
        self.lm_head.load(lm_head if lm_head is not None else state_dict["model.embed_tokens.weight"])
        self.norm.weight.data = sd.pop("model.norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            names = ("q_proj", "k_proj", "v_proj")
            biases = [sd.pop(f"{p}self_attn.{n}.bias") for n in names] if attn.qkv_proj.bias is not None else None
            attn.qkv_proj.load([sd.pop(f"{p}self_attn.{n}.weight") for n in names], biases)
            attn.o_proj.load(sd.pop(f"{p}self_attn.o_proj.weight"))
            layer.mlp.gate_up_proj.load([sd.pop(f"{p}mlp.gate_proj.weight"), sd.pop(f"{p}mlp.up_proj.weight")])
            layer.mlp.down_proj.load(sd.pop(f"{p}mlp.down_proj.weight"))
            layer.input_layernorm.weight.data = sd.pop(f"{p}input_layernorm.weight")
            layer.post_attention_layernorm.weight.data = sd.pop(f"{p}post_attention_layernorm.weight")
        leftover = [k for k in sd if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}{'...' if len(leftover) > 5 else ''}")
