"""The decoder every supported family runs on: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3,
Granite, OLMo 2, SmolLM3 (``decoder_spec.py`` lists what sets them apart).

One layer class serves them all; a family's ``DecoderSpec`` switches its parts on:
q/k norms, norms on the branch outputs, Gemma's ``(1 + w)`` norms, the activation, the
scales and soft-caps, each layer's sliding window and rotary table.

Weights arrive in Hugging Face naming through ``load_weights`` (GGUF files are renamed to
it by the loader); q/k/v and gate/up are fused into one matmul each (fewer kernel launches
per token; Phi-3 ships them fused). With GGUF-quantized weights on a CPU, each layer's norms,
matmuls, q/k norms, rotary, activation and residual adds run as two compiled calls around
attention (``quant_layer``; ``use_cpu_layer_kernels``), the spec's differences passed as
parameters.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import SINGLE, TensorParallelGroup
from specserve.model_executor.layers.attention import AttentionMetadata, paged_attention
from specserve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from specserve.model_executor.layers.lora import LoraRows, LoraWeights
from specserve.model_executor.layers.norm import RMSNorm
from specserve.model_executor.layers.quantized import QuantizedMatrix
from specserve.model_executor.layers.quant_layer import QuantizedLayerKernel, QuantizedLayerStack
from specserve.model_executor.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from specserve.model_executor.models.decoder_spec import DecoderSpec, LayerSpec, spec_for

Rope = tuple[torch.Tensor, torch.Tensor]   # cos, sin [T, 1, rotary_dim] for a step's positions


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over a whole projection (all heads at once: OLMo 2's q and k norms).

    Under tensor parallelism a rank holds some heads only, so the sum of squares is summed
    over ranks before dividing by the full width; each rank keeps its heads' weights.
    """

    def __init__(self, full_width: int, local_start: int, local_width: int, eps: float, tp: TensorParallelGroup):
        super().__init__()
        self.full_width, self.local_start, self.eps, self.tp = full_width, local_start, eps, tp
        self.weight = nn.Parameter(torch.ones(local_width), requires_grad=False)

    def load(self, full: torch.Tensor) -> None:
        self.weight.data = full[self.local_start : self.local_start + self.weight.shape[0]].clone()

    def kernel_weight(self) -> torch.Tensor:
        """[local_width] float32 (the compiled CPU kernels' input; TP 1 there)."""
        return self.weight.data.float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, local_width]
        h = x.float()
        sum_sq = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))   # [T, 1]
        return (self.weight * (h * torch.rsqrt(sum_sq / self.full_width + self.eps))).to(x.dtype)


class DecoderAttention(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup, spec: DecoderSpec, layer: LayerSpec):
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
        q_start, self.num_heads = tp.shard(self.total_heads, "num_attention_heads", kv_groups)
        kv_start, self.num_kv_heads = tp.shard(self.total_kv_heads, "num_key_value_heads", kv_groups)
        self.qkv_proj = ColumnParallelLinear(
            hidden,
            [self.total_heads * self.head_dim, self.total_kv_heads * self.head_dim, self.total_kv_heads * self.head_dim],
            bias=spec.qkv_bias,
            tp=tp,
            num_units=kv_groups,
        )
        self.o_proj = RowParallelLinear(self.total_heads * self.head_dim, hidden, bias=False, tp=tp, num_units=kv_groups)
        self.scale = spec.attn_scale
        self.sliding_window = layer.sliding_window   # read by paged attention and quant_layer
        self.logit_softcap = spec.attn_softcap
        self.q_norm = self.k_norm = None
        eps, hd = config.rms_norm_eps, self.head_dim
        if spec.qk_norm == "head":      # per head, before the rotary (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(hd, eps, spec.norm_offset)
            self.k_norm = RMSNorm(hd, eps, spec.norm_offset)
        elif spec.qk_norm == "all":     # over the whole projection (OLMo 2)
            self.q_norm = FullWidthRMSNorm(self.total_heads * hd, q_start * hd, self.num_heads * hd, eps, tp)
            self.k_norm = FullWidthRMSNorm(self.total_kv_heads * hd, kv_start * hd, self.num_kv_heads * hd, eps, tp)
        self.qk_norm = spec.qk_norm

    def forward(self, rope: Rope | None, x, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hk) * hd]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qk_norm == "all":
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=-1)
        else:
            qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
        qk = qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim)   # [T, Hq + Hk, hd]
        if self.qk_norm == "head":
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if rope is not None:
            # q and k are adjacent in the fused output: rotate both in one go.
            qk = apply_rotary(qk, *rope)
        out = self.attend(qk, v, kv_cache, meta)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def attend(self, qk: torch.Tensor, v: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """qk [T, Hq + Hk, hd] rotated, v [T, Hk * hd] -> attention output [T, Hq, hd] (K/V cached)."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return paged_attention(q, k, v, kv_cache, meta, self.scale,
                               sliding_window=self.sliding_window, logit_softcap=self.logit_softcap)


class DecoderMLP(nn.Module):
    """down(act(gate) * up), gate and up in one matmul."""

    def __init__(self, config, tp: TensorParallelGroup, spec: DecoderSpec):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], bias=False, tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, tp=tp)
        self.activation = spec.activation

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * up)


def _maybe_norm(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class DecoderLayer(nn.Module):
    """x += [out_norm](attention([norm](x))) ; x += [out_norm](mlp([norm](x))), the bracketed norms
    as the spec's ``norms`` says, each branch times ``residual_scale``."""

    def __init__(self, config, tp: TensorParallelGroup, spec: DecoderSpec, index: int):
        super().__init__()
        layer = spec.layers[index]
        self.rope_key = layer.rope
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, spec.norm_offset

        def norm_if(present: bool) -> RMSNorm | None:
            return RMSNorm(hidden, eps, offset) if present else None

        self.attn_norm = norm_if(spec.norms in ("pre", "sandwich"))      # before attention
        self.mlp_norm = norm_if(spec.norms in ("pre", "sandwich"))       # before the MLP
        self.attn_out_norm = norm_if(spec.norms in ("sandwich", "post"))  # on attention's output
        self.mlp_out_norm = norm_if(spec.norms in ("sandwich", "post"))   # on the MLP's output
        self.self_attn = DecoderAttention(config, tp, spec, layer)
        self.mlp = DecoderMLP(config, tp, spec)
        self.residual_scale = spec.residual_scale

    def forward(self, rope: Rope | None, x, kv_cache, meta):
        h = _maybe_norm(self.attn_out_norm, self.self_attn(rope, _maybe_norm(self.attn_norm, x), kv_cache, meta))
        x = x + h * self.residual_scale if self.residual_scale != 1.0 else x + h
        h = _maybe_norm(self.mlp_out_norm, self.mlp(_maybe_norm(self.mlp_norm, x)))
        return x + h * self.residual_scale if self.residual_scale != 1.0 else x + h


class DecoderForCausalLM(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup = SINGLE, max_positions: int = 8192):
        super().__init__()
        self.config = config
        self.tp = tp
        self.spec = spec = spec_for(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, tp, spec, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, spec.norm_offset)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        first = self.layers[0].self_attn
        self.num_kv_heads_local = first.num_kv_heads
        self.head_dim = first.head_dim
        # one rotary table per distinct rope of the layers ("" = the config's only one)
        self.rotaries = nn.ModuleDict({
            key or "default": RotaryEmbedding.from_config(config, max_positions, key or None)
            for key in spec.rope_layer_types})
        self.layer_kernels: list[QuantizedLayerKernel] | None = None   # set by use_cpu_layer_kernels
        self.layer_stack: QuantizedLayerStack | None = None            # ... and all of them in one call
        # Layers whose input (the residual stream before them) ``forward`` also returns, after the
        # final hidden state: an EAGLE-3 head's features (``set_feature_layers``).
        self.feature_layers: tuple[int, ...] = ()
        self._segments: list | None = None       # the layer stack cut at the feature layers (_stack_segments)
        self.lora_rows: LoraRows | None = None   # a step's rows by LoRA adapter (enable_lora)

    def rotary(self, key: str) -> RotaryEmbedding:
        return self.rotaries[key or "default"]

    def use_cpu_layer_kernels(self) -> bool:
        """Run every layer through ``quant_layer``'s two compiled calls when all of them can
        (quantized weights, TP 1, CPU, kernel built); returns whether they do."""
        kernels = [QuantizedLayerKernel.for_layer(layer, self.config.rms_norm_eps, self.tp.world_size,
                                                  None if layer.rope_key is None else self.rotary(layer.rope_key))
                   for layer in self.layers]
        self.layer_kernels = kernels if kernels and all(k is not None for k in kernels) else None
        self.layer_stack = QuantizedLayerStack.build(kernels) if self.layer_kernels is not None else None
        self._segments = None
        return self.layer_kernels is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden]
        x = self.embed_tokens(input_ids)
        if self.spec.embed_scale != 1.0:
            # in the embedding's dtype, as the references scale (Gemma casts sqrt(hidden) to it)
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def _stack_segments(self) -> list[tuple[int, int, QuantizedLayerStack | None]]:
        """The compiled layer stack cut at the feature layers: (first layer, end, the stack of
        layers first..end-1, None when empty); one segment when there are none."""
        if self._segments is None:
            cuts = sorted(set(self.feature_layers))
            spans = list(zip([0, *cuts], [*cuts, len(self.layers)]))
            self._segments = [(a, b, (self.layer_stack if (a, b) == (0, len(self.layers))
                                      else QuantizedLayerStack.build(self.layer_kernels[a:b]) if b > a else None))
                              for a, b in spans]
        return self._segments

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """``forward`` returns, after the final hidden state, the residual stream before each of
        ``layers`` (an EAGLE-3 head's features): [T, hidden * (1 + len(layers))]."""
        bad = [i for i in layers if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"feature layers {bad} are not among the target's {len(self.layers)} layers")
        self.feature_layers = tuple(layers)
        self._segments = None

    def _linears(self, layer: DecoderLayer) -> dict[str, nn.Module]:
        return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
                "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}

    def enable_lora(self) -> LoraRows:
        """Give every projection room for LoRA adapters (``layers/lora.py``); returns the rows
        object the runner sets before each forward."""
        if self.lora_rows is None:
            self.lora_rows = LoraRows()
            for layer in self.layers:
                for linear in self._linears(layer).values():
                    linear.lora = LoraWeights(self.lora_rows)
        return self.lora_rows

    def add_lora(self, adapter_id: int, modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype) -> None:
        """An adapter's full matrices {(layer, Hugging Face projection name): (A [r, in], B [out, r])}
        (the scale folded into B: ``lora.peft_adapter``), kept in ``dtype`` (the activations'); each
        layer keeps its shard."""
        assert self.lora_rows is not None, "enable_lora first"
        device = self.norm.weight.device
        for i, layer in enumerate(self.layers):
            attn, lin = layer.self_attn, self._linears(layer)
            get = lambda name: modules.get((i, name))   # noqa: E731
            qkv = [get("q_proj"), get("k_proj"), get("v_proj")]
            if get("qkv_proj") is not None:             # Phi-3's fused projection: one A, B cut by rows
                a, b = get("qkv_proj")
                q_size, kv_size = attn.total_heads * attn.head_dim, attn.total_kv_heads * attn.head_dim
                qkv = [(a, part) for part in b.split([q_size, kv_size, kv_size])]
            gate_up = [get("gate_proj"), get("up_proj")]
            if get("gate_up_proj") is not None:
                a, b = get("gate_up_proj")
                gate_up = [(a, part) for part in b.chunk(2)]
            lin["qkv"].set_lora(adapter_id, qkv, dtype, device)
            lin["o"].set_lora(adapter_id, get("o_proj"), dtype, device)
            lin["gate_up"].set_lora(adapter_id, gate_up, dtype, device)
            lin["down"].set_lora(adapter_id, get("down_proj"), dtype, device)

    def remove_lora(self, adapter_id: int) -> None:
        for kernel in self.layer_kernels or []:
            kernel.forget_adapters()        # never left pointing into a dropped adapter
        for layer in self.layers:
            for linear in self._linears(layer).values():
                if linear.lora is not None:
                    linear.lora.remove(adapter_id)

    def forward(
        self,
        input_ids: torch.Tensor,   # [T]
        positions: torch.Tensor,   # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, Hk, num_blocks, block_size, hd]
        meta: AttentionMetadata,
    ) -> torch.Tensor:             # [T, hidden] after the final norm (then the feature layers' inputs)
        x = self.embed(input_ids)
        features: list[torch.Tensor] = []
        if self.layer_kernels is not None and x.device.type == "cpu":
            self._point_kernels_at_adapters()
            x = self._forward_layer_kernels(x, positions, kv_caches, meta, features)
        else:
            if positions.device.type == "cpu":   # elsewhere the check would wait for the device
                self._check_positions(positions)    # (ModelRunner checks its host copy)
            ropes = {key: table.lookup(positions, x.dtype) for key, table in self.rotaries.items()}
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                if i in self.feature_layers:
                    features.append(x)
                rope = None if layer.rope_key is None else ropes[layer.rope_key or "default"]
                x = layer(rope, x, kv_cache, meta)
        out = self.norm(x)
        if not self.feature_layers:
            return out
        by_layer = dict(zip(sorted(set(self.feature_layers)), features))
        return torch.cat([out, *(by_layer[i].to(out.dtype) for i in self.feature_layers)], dim=-1)

    def _point_kernels_at_adapters(self) -> None:
        """Tell the compiled layers each row's LoRA adapter this step (none without LoRA rows)."""
        rows = self.lora_rows
        if rows is None:          # LoRA never enabled: the kernels' row pointers stay NULL
            return
        if not rows.active:
            for kernel in self.layer_kernels:
                kernel.use_adapters((), None)
            return
        adapters = tuple(a for a, _ in rows.groups)
        entry = {a: j for j, a in enumerate(adapters, 1)}
        self._lora_row_entries = torch.tensor([entry.get(a, 0) for a in rows.row_adapters], dtype=torch.int32)  # [T]
        for kernel in self.layer_kernels:
            kernel.use_adapters(adapters, self._lora_row_entries)

    def _check_positions(self, positions: torch.Tensor) -> None:
        for table in self.rotaries.values():
            if positions.numel() and int(positions.max()) >= table.cos.shape[0]:
                raise ValueError(f"position {int(positions.max())} beyond the rotary table ({table.cos.shape[0]})")

    def _forward_layer_kernels(self, x, positions, kv_caches, meta, features: list) -> torch.Tensor:
        """The layers as quant_layer's compiled halves around attention; x [T, hidden] float32
        (updated in place: the feature layers' inputs are copied into ``features``)."""
        self._check_positions(positions)
        x = x.float().contiguous()
        positions = positions.to(torch.int64).contiguous()
        tokens = x.shape[0]
        scratch = torch.empty_like(x)                                              # [T, hidden]
        gate_up = torch.empty(tokens, 2 * self.config.intermediate_size)   # [T, 2 I] (TP 1 only)
        if self.layer_stack is not None and meta.kernel is not None:
            # every layer, attention included, in one call (with feature layers: one call a run of layers
            # between them, each feature layer's input copied before its run)
            scale = self.layers[0].self_attn.scale
            for start, end, stack in self._stack_segments():
                if start in self.feature_layers:
                    features.append(x.clone())
                if stack is not None:
                    stack.run(x, positions, kv_caches[start:end], meta, scale, scratch, gate_up)
            return x
        for i, (layer, kernel, kv_cache) in enumerate(zip(self.layers, self.layer_kernels, kv_caches)):
            if i in self.feature_layers:
                features.append(x.clone())
            attn = layer.self_attn
            qkv = kernel.attn_in(x, positions, scratch)                                 # [T, (Hq + 2 Hk) hd]
            qk, v = qkv.split([(attn.num_heads + attn.num_kv_heads) * attn.head_dim, attn.num_kv_heads * attn.head_dim],
                              dim=-1)
            out = attn.attend(qk.view(tokens, -1, attn.head_dim), v, kv_cache, meta)     # [T, Hq, hd]
            kernel.mlp(x, out.reshape(tokens, -1), scratch, gate_up)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        logits = self.lm_head.compute_logits(hidden)
        if logits is None:   # a tensor-parallel rank other than the driver
            return logits
        if self.spec.logits_divisor != 1.0:
            logits = logits / self.spec.logits_divisor
        if self.spec.final_softcap is not None:
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) Hugging Face tensors; each layer keeps its shard."""
        sd = dict(state_dict)
        self.embed_tokens.load(sd.pop("model.embed_tokens.weight"))
        lm_head = sd.pop("lm_head.weight", None)  # absent when tied to the embeddings
        self.lm_head.load(lm_head if lm_head is not None else state_dict["model.embed_tokens.weight"])
        self.norm.load(sd.pop("model.norm.weight"))
        for i, layer in enumerate(self.layers):
            _load_layer(layer, f"model.layers.{i}.", sd, self.spec)
        leftover = [k for k in sd if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}{'...' if len(leftover) > 5 else ''}")


# Each layer norm's Hugging Face name, by the spec's norm placement. Llama's
# "post_attention_layernorm" is the norm BEFORE the MLP; Gemma's and OLMo 2's is the norm
# on attention's OUTPUT.
_NORM_NAMES = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "sandwich": {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
    "post": {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
}


def _load_layer(layer: DecoderLayer, p: str, sd: dict[str, torch.Tensor], spec: DecoderSpec) -> None:
    """One layer's tensors (prefix ``p``) popped from ``sd`` into the fused layers."""
    attn = layer.self_attn
    if f"{p}self_attn.qkv_proj.weight" in sd:   # Phi-3: q, k, v already one matrix
        q_size, kv_size = attn.total_heads * attn.head_dim, attn.total_kv_heads * attn.head_dim
        attn.qkv_proj.load(_split_rows(sd.pop(f"{p}self_attn.qkv_proj.weight"), [q_size, kv_size, kv_size]))
    else:
        names = ("q_proj", "k_proj", "v_proj")
        biases = [sd.pop(f"{p}self_attn.{n}.bias") for n in names] if attn.qkv_proj.bias is not None else None
        attn.qkv_proj.load([sd.pop(f"{p}self_attn.{n}.weight") for n in names], biases)
    attn.o_proj.load(sd.pop(f"{p}self_attn.o_proj.weight"))
    if f"{p}mlp.gate_up_proj.weight" in sd:     # Phi-3: gate and up already one matrix
        fused = sd.pop(f"{p}mlp.gate_up_proj.weight")
        layer.mlp.gate_up_proj.load(_split_rows(fused, [fused.shape[0] // 2] * 2))
    else:
        layer.mlp.gate_up_proj.load([sd.pop(f"{p}mlp.gate_proj.weight"), sd.pop(f"{p}mlp.up_proj.weight")])
    layer.mlp.down_proj.load(sd.pop(f"{p}mlp.down_proj.weight"))
    for attr, hf_name in _NORM_NAMES[spec.norms].items():
        getattr(layer, attr).load(sd.pop(f"{p}{hf_name}.weight"))
    if attn.q_norm is not None:
        attn.q_norm.load(sd.pop(f"{p}self_attn.q_norm.weight"))
        attn.k_norm.load(sd.pop(f"{p}self_attn.k_norm.weight"))


def _split_rows(weight, sizes: list[int]) -> list:
    """A fused checkpoint matrix [sum(sizes), in] cut into its parts by rows (dense or GGUF blocks)."""
    if isinstance(weight, QuantizedMatrix):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [weight.row_slice(start, n) for start, n in zip(starts, sizes)]
    return list(weight.split(sizes))
