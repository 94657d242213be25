"""An EAGLE-3 draft head, read from the checkpoints vLLM and SGLang serve (``config.json`` with an
``Eagle3`` architecture, ``model.safetensors``).

Where an EAGLE-1 head (``eagle.py``) reads the target's final hidden state, an EAGLE-3 head reads
the residual stream before three of the target's layers (low, middle, high: by default
2, L/2 and L-3; ``eagle_aux_hidden_state_layer_ids`` in its config names others) and maps them
to its width with ``fc``. Its one decoder layer attends over both the token's embedding and the
feature::

    h = fc([a_low ; a_mid ; a_high])                       # the target's features [T, 3 Ht] -> [T, H]
        (or, drafting, the head's own previous state h)
    x = attention([input_layernorm(embed(x_{t+1})) ; hidden_norm(h)])    # [T, 2H] in, [T, H] out
    r = h + x
    state = r + mlp(post_attention_layernorm(r))           # fed back as the next draft's h
    logits = lm_head(norm(state))                          # its own LM head over a draft vocabulary

The draft vocabulary's token ``i`` is the target's ``i + d2t[i]``. The embedding is the target's
unless the checkpoint carries its own. ``forward`` returns ``[norm(state) ; state]`` ([T, 2H]):
the proposer takes logits from the first half (``logits_input``), and a row fed back as a
feature is told from the target's rows by its width.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model_executor.layers.attention import AttentionMetadata
from specserve.model_executor.layers.linear import ColumnParallelLinear
from specserve.model_executor.layers.norm import RMSNorm
from specserve.model_executor.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.model_executor.models.decoder import DecoderLayer
from specserve.model_executor.models.decoder_spec import eagle_layer_spec
from specserve.model_executor.models.eagle import HeadLayerShape, attend_own_step

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class Eagle3Config(HeadLayerShape):
    """The head's shape (the attention's and MLP's are a Llama layer's), from its ``config.json``."""

    vocab_size: int                    # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]    # the target layers whose inputs it reads
    hf: dict                           # the whole config.json (its rope settings build the rotary table)

    @classmethod
    def load(cls, folder: str, target_num_layers: int) -> "Eagle3Config":
        with open(os.path.join(folder, "config.json")) as f:
            hf = json.load(f)
        heads = hf["num_attention_heads"]
        eagle = hf.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids") or hf.get("eagle_aux_hidden_state_layer_ids") \
            or default_feature_layers(target_num_layers)
        return cls(
            hidden_size=hf["hidden_size"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"],
            feature_layers=tuple(int(i) for i in layers), hf=hf)


def target_config_dict(target_config) -> dict:
    """The rope settings of the target's config (a head trained for it uses the same table)."""
    d = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(vars(target_config))
    return {k: d[k] for k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings") if k in d}


def eagle3_config_for(target_config, draft_vocab_size: int | None, feature_layers: tuple[int, ...]) -> Eagle3Config:
    """The shape of an EAGLE-3 head for ``target_config`` (its layer's sizes are the target's)."""
    heads = target_config.num_attention_heads
    return Eagle3Config(
        hidden_size=target_config.hidden_size, num_attention_heads=heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        intermediate_size=target_config.intermediate_size, rms_norm_eps=target_config.rms_norm_eps,
        vocab_size=target_config.vocab_size, draft_vocab_size=draft_vocab_size or target_config.vocab_size,
        target_hidden_size=target_config.hidden_size, feature_layers=tuple(feature_layers),
        hf={"model_type": "llama", **target_config_dict(target_config)})


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice: low, middle and high (2, L/2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


def is_eagle3_folder(path: str | None) -> bool:
    """A folder whose config.json names an EAGLE-3 architecture (``LlamaForCausalLMEagle3``, ...)."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    with open(os.path.join(path, "config.json")) as f:
        try:
            archs = json.load(f).get("architectures") or []
        except ValueError:
            return False
    return any("eagle3" in a.lower() for a in archs)


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, max_positions: int = 8192):
        super().__init__()
        from transformers import LlamaConfig

        from specserve.distributed.parallel_state import SINGLE

        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(len(config.feature_layers) * config.target_hidden_size, h, bias=False)
        self.embed_norm = RMSNorm(h, eps)      # the checkpoint's input_layernorm: on the token's embedding
        self.hidden_norm = RMSNorm(h, eps)     # on the feature
        self.layer = DecoderLayer(config, SINGLE, eagle_layer_spec(config.head_dim), 0)
        attn = self.layer.self_attn
        kv = config.num_key_value_heads * config.head_dim
        # its attention reads [embedding ; feature]: twice the width its output has
        attn.qkv_proj = ColumnParallelLinear(2 * h, [config.num_attention_heads * config.head_dim, kv, kv], bias=False)
        self.norm = RMSNorm(h, eps)
        self.lm_head = ColumnParallelLinear(h, [config.draft_vocab_size], bias=False)   # [Vd, H]
        self.embed_tokens: nn.Embedding | None = None                                 # its own, if it has one
        rope_config = LlamaConfig(hidden_size=h, num_attention_heads=config.num_attention_heads,
                                  head_dim=config.head_dim, **{k: v for k, v in config.hf.items() if k in (
                                      "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")})
        self.rotary = RotaryEmbedding.from_config(rope_config, max_positions)
        self.num_kv_heads_local = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.register_buffer("draft_vocab", None, persistent=False)   # [Vd] the target's ids

    @property
    def target_width(self) -> int:
        """The width of the target's rows it reads: the final hidden state, then the features."""
        return self.config.target_hidden_size * (1 + len(self.config.feature_layers))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """vLLM's names (``midlayer.*`` or ``layers.0.*``, an optional ``model.`` prefix) -> the modules."""
        sd = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v for k, v in sd.items()}
        self.fc.weight.data = sd.pop("fc.weight")
        self.norm.load(sd.pop("norm.weight"))
        self.lm_head.load([sd.pop("lm_head.weight")])
        d2t = sd.pop("d2t", None)
        sd.pop("t2d", None)                   # the target -> draft map: the proposer needs only d2t
        rows = torch.arange(self.config.draft_vocab_size)
        self.draft_vocab = rows + d2t.long() if d2t is not None else None
        embed = sd.pop("embed_tokens.weight", None)
        if embed is not None:
            self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        p, layer = "midlayer.", self.layer
        self.embed_norm.load(sd.pop(f"{p}input_layernorm.weight"))
        self.hidden_norm.load(sd.pop(f"{p}hidden_norm.weight"))
        layer.mlp_norm.load(sd.pop(f"{p}post_attention_layernorm.weight"))
        layer.self_attn.qkv_proj.load([sd.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"])
        layer.self_attn.o_proj.load(sd.pop(f"{p}self_attn.o_proj.weight"))
        layer.mlp.gate_up_proj.load([sd.pop(f"{p}mlp.gate_proj.weight"), sd.pop(f"{p}mlp.up_proj.weight")])
        layer.mlp.down_proj.load(sd.pop(f"{p}mlp.down_proj.weight"))
        if sd:
            raise ValueError(f"unexpected weights in the EAGLE-3 head: {sorted(sd)[:5]}")

    def forward(
        self,
        features: torch.Tensor,      # [T, target_width] the target's rows, or [T, 2H] the head's own
        token_embeds: torch.Tensor,  # [T, H] embeddings of the tokens that follow them
        positions: torch.Tensor,     # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:               # [T, 2H]: [norm(state) ; state]
        h = self.config.hidden_size
        if features.shape[-1] == self.target_width:
            state = self.fc(features[:, self.config.target_hidden_size:])
        else:
            state = features[:, h:]
        rope = self.rotary.lookup(positions, state.dtype)
        x = torch.cat([self.embed_norm(token_embeds), self.hidden_norm(state)], dim=-1)
        r = state + self.layer.self_attn(rope, x, kv_cache, meta)
        state = r + self.layer.mlp(self.layer.mlp_norm(r))
        return torch.cat([self.norm(state), state], dim=-1)

    def logits_input(self, rows: torch.Tensor) -> torch.Tensor:   # [n, 2H] -> [n, H]
        return rows[..., : self.config.hidden_size]

    # ------------------------------------------------------------ training
    def forward_train(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """[B, L, 3 Ht] the target's features, [B, L, H] embeddings -> [B, L, 2H], as ``forward``
        over whole padded sequences with causal attention (no KV cache)."""
        state = self.fc(features)
        q, k, v = self._train_qkv(state, token_embeds)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self._train_finish(state, out)

    def forward_train_unrolled(self, features, token_embeds) -> tuple[torch.Tensor, torch.Tensor]:
        """(pass 1 as ``forward_train``; pass 2 where position j's feature is the head's own
        state from pass 1 at j - 1, keys before j keeping the target's): what the head sees when
        it drafts a second token (EAGLE's training-time test)."""
        state1 = self.fc(features)
        q1, k1, v1 = self._train_qkv(state1, token_embeds)
        gqa = q1.shape[1] != k1.shape[1]
        out1 = self._train_finish(state1, F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=gqa))
        h = self.config.hidden_size
        # position 0 has no own feature; not detached, unlike the EAGLE-1 head's: the second pass's
        # loss reaches the first pass's state too
        state2 = torch.cat([state1[:, :1], out1[:, :-1, h:]], dim=1)
        q2, k2, v2 = self._train_qkv(state2, token_embeds)
        return out1, self._train_finish(state2, attend_own_step(q2, k1, v1, k2, v2))

    def _train_qkv(self, state, token_embeds):
        """-> q [B, hq, L, hd], k and v [B, hk, L, hd] of [embedding ; feature] at positions 0..L-1."""
        b, length, _ = state.shape
        attn = self.layer.self_attn
        hq, hk, hd = self.config.num_attention_heads, self.config.num_key_value_heads, self.head_dim
        x = torch.cat([self.embed_norm(token_embeds), self.hidden_norm(state)], dim=-1)
        qkv = attn.qkv_proj(x)                                                     # [B, L, (hq + 2hk) hd]
        qk, v = qkv.split([(hq + hk) * hd, hk * hd], dim=-1)
        cos, sin = self.rotary.lookup(torch.arange(length, device=state.device), state.dtype)
        qk = apply_rotary(qk.reshape(b, length, hq + hk, hd), cos, sin)
        q, k = qk.split([hq, hk], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.reshape(b, length, hk, hd).transpose(1, 2)

    def _train_finish(self, state, attn_out):
        """the feature [B, L, H], attention's output [B, hq, L, hd] -> [B, L, 2H]."""
        b, hq, length, hd = attn_out.shape
        r = state + self.layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, length, hq * hd))
        state = r + self.layer.mlp(self.layer.mlp_norm(r))
        return torch.cat([self.norm(state), state], dim=-1)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """vLLM's names (the inverse of ``load_weights``)."""
        cfg, layer = self.config, self.layer
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        q, k, v = layer.self_attn.qkv_proj.weight.detach().split([q_size, kv_size, kv_size])
        gate, up = layer.mlp.gate_up_proj.weight.detach().chunk(2)
        p = "midlayer."
        sd = {"fc.weight": self.fc.weight.detach(), "norm.weight": self.norm.weight.detach(),
              "lm_head.weight": self.lm_head.weight.detach(),
              f"{p}input_layernorm.weight": self.embed_norm.weight.detach(),
              f"{p}hidden_norm.weight": self.hidden_norm.weight.detach(),
              f"{p}post_attention_layernorm.weight": layer.mlp_norm.weight.detach(),
              f"{p}self_attn.q_proj.weight": q, f"{p}self_attn.k_proj.weight": k, f"{p}self_attn.v_proj.weight": v,
              f"{p}self_attn.o_proj.weight": layer.self_attn.o_proj.weight.detach(),
              f"{p}mlp.gate_proj.weight": gate, f"{p}mlp.up_proj.weight": up,
              f"{p}mlp.down_proj.weight": layer.mlp.down_proj.weight.detach()}
        if self.draft_vocab is not None:
            sd["d2t"] = self.draft_vocab - torch.arange(len(self.draft_vocab), device=self.draft_vocab.device)
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[self.draft_vocab.cpu()] = True
            sd["t2d"] = t2d
        return {k: t.contiguous() for k, t in sd.items()}


def save_eagle3_head(folder: str, head: Eagle3Head, dtype: torch.dtype = torch.bfloat16) -> None:
    """The head as vLLM reads it: ``config.json`` (an ``LlamaForCausalLMEagle3``) and ``model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    sd = {k: (t.to(dtype) if t.is_floating_point() else t).cpu() for k, t in head.export_weights().items()}
    save_file(sd, os.path.join(folder, WEIGHT_FILES[0]))
    cfg = head.config
    hf = {**cfg.hf, "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": cfg.hidden_size,
          "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
          "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
          "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
          "target_hidden_size": cfg.target_hidden_size, "num_hidden_layers": 1,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers)}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)


def load_eagle3_head(folder: str, dtype: torch.dtype, target_num_layers: int,
                     max_positions: int = 8192) -> Eagle3Head:
    config = Eagle3Config.load(folder, target_num_layers)
    path = next((os.path.join(folder, n) for n in WEIGHT_FILES if os.path.isfile(os.path.join(folder, n))), None)
    if path is None:
        raise ValueError(f"{folder!r} has no {' or '.join(WEIGHT_FILES)}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(path)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    head = Eagle3Head(config, max_positions)
    head.load_weights({k: (t.to(dtype) if t.is_floating_point() else t) for k, t in sd.items()})
    return head
