"""An EAGLE-1-style draft head: one decoder layer over [target feature, next-token embedding].

At position t the target's final (post-norm) hidden state ``f_t`` and the token
that follows it, ``x_{t+1}``, go in::

    x = fc([f_t ; embed(x_{t+1})])          # [T, 2H] -> [T, H]
    h = norm(decoder_layer(x))              # attends to the head's earlier positions
    logits = h @ lm_head[draft_vocab].T     # predicts x_{t+2}

``h`` is trained to equal ``f_{t+1}`` (and its logits to match the target's),
so when drafting the head feeds its own ``h`` back in as the next feature.
The embedding and the LM head are the target's, frozen and never saved; the
LM head may be cut to a draft vocabulary (the most frequent target tokens),
which makes both drafting and training several times cheaper.

On disk a head is a folder: ``eagle_config.json`` + ``model.safetensors``
(``fc.weight``, ``layer.*`` in Hugging Face naming, ``norm.weight`` and, for a
reduced vocabulary, ``draft_vocab``: the int64 target token ids it can draft).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model_executor.layers.attention import AttentionMetadata
from specserve.model_executor.layers.norm import RMSNorm
from specserve.model_executor.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.model_executor.models.decoder import DecoderLayer
from specserve.model_executor.models.decoder_spec import eagle_layer_spec

EAGLE_CONFIG_NAME = "eagle_config.json"
EAGLE_WEIGHTS_NAME = "model.safetensors"


@dataclass
class HeadLayerShape:
    """An EAGLE head's one Llama layer: what ``DecoderLayer`` reads of a config (EAGLE and EAGLE-3 alike)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float


@dataclass
class EagleConfig(HeadLayerShape):
    """The head's shape; the attention/MLP sizes are a Llama decoder layer's."""

    rope_theta: float
    vocab_size: int                    # the target's vocabulary (checked at load)
    draft_vocab_size: int              # rows of the LM head the head drafts from (<= vocab_size)
    target: str = ""                   # the target it was trained for (display only)
    architecture: str = "EagleHead"
    model_type: str = "llama"          # what the decoder layer is
    hidden_act: str = "silu"
    training: dict = field(default_factory=dict)  # how it was trained (free-form, for the record)
    # The k this head was measured fastest at; used when the user sets none.
    num_speculative_tokens: int | None = None

    @classmethod
    def from_target(cls, config, draft_vocab_size: int | None = None, target: str = "") -> "EagleConfig":
        from specserve.model_executor.layers.rotary import rope_theta_of

        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope_theta_of(config),
            vocab_size=config.vocab_size,
            draft_vocab_size=draft_vocab_size or config.vocab_size,
            target=target,
        )

    def save(self, folder: str) -> None:
        with open(os.path.join(folder, EAGLE_CONFIG_NAME), "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, folder: str) -> "EagleConfig":
        with open(os.path.join(folder, EAGLE_CONFIG_NAME)) as f:
            values = json.load(f)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


def is_eagle_folder(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, EAGLE_CONFIG_NAME))


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, max_positions: int = 8192):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config, _single_tp(), eagle_layer_spec(config.head_dim), 0)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding.plain(config.head_dim, max_positions, config.rope_theta)
        self.num_kv_heads_local = config.num_key_value_heads
        self.head_dim = config.head_dim
        # The target's token ids the LM head rows stand for (None = the whole vocabulary).
        self.register_buffer("draft_vocab", None, persistent=False)

    # ------------------------------------------------------------- weights I/O
    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Hugging Face names (``layer.self_attn.q_proj.weight``...) -> fused layers."""
        sd = dict(sd)
        self.fc.weight.data = sd.pop("fc.weight")
        self.norm.weight.data = sd.pop("norm.weight")
        vocab = sd.pop("draft_vocab", None)
        self.draft_vocab = vocab.long() if vocab is not None else None
        p, layer = "layer.", self.layer
        layer.self_attn.qkv_proj.load([sd.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"])
        layer.self_attn.o_proj.load(sd.pop(f"{p}self_attn.o_proj.weight"))
        layer.mlp.gate_up_proj.load([sd.pop(f"{p}mlp.gate_proj.weight"), sd.pop(f"{p}mlp.up_proj.weight")])
        layer.mlp.down_proj.load(sd.pop(f"{p}mlp.down_proj.weight"))
        layer.attn_norm.load(sd.pop(f"{p}input_layernorm.weight"))
        layer.mlp_norm.load(sd.pop(f"{p}post_attention_layernorm.weight"))
        if sd:
            raise ValueError(f"unexpected weights in the EAGLE head: {sorted(sd)[:5]}")

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The inverse of ``load_weights`` (unfused, Hugging Face names)."""
        layer = self.layer
        q_size = self.config.num_attention_heads * self.head_dim
        kv_size = self.config.num_key_value_heads * self.head_dim
        q, k, v = layer.self_attn.qkv_proj.weight.detach().split([q_size, kv_size, kv_size])
        gate, up = layer.mlp.gate_up_proj.weight.detach().chunk(2)
        sd = {
            "fc.weight": self.fc.weight.detach(),
            "norm.weight": self.norm.weight.detach(),
            "layer.self_attn.q_proj.weight": q,
            "layer.self_attn.k_proj.weight": k,
            "layer.self_attn.v_proj.weight": v,
            "layer.self_attn.o_proj.weight": layer.self_attn.o_proj.weight.detach(),
            "layer.mlp.gate_proj.weight": gate,
            "layer.mlp.up_proj.weight": up,
            "layer.mlp.down_proj.weight": layer.mlp.down_proj.weight.detach(),
            "layer.input_layernorm.weight": layer.attn_norm.weight.detach(),
            "layer.post_attention_layernorm.weight": layer.mlp_norm.weight.detach(),
        }
        if self.draft_vocab is not None:
            sd["draft_vocab"] = self.draft_vocab
        return {k: t.contiguous() for k, t in sd.items()}

    # ---------------------------------------------------------------- forwards
    def forward(
        self,
        features: torch.Tensor,    # [T, H] target (or the head's own) post-norm hidden states
        token_embeds: torch.Tensor,  # [T, H] embeddings of the tokens that follow them
        positions: torch.Tensor,   # [T]
        kv_cache: torch.Tensor,    # [2, Hk, num_blocks, block_size, hd]
        meta: AttentionMetadata,
    ) -> torch.Tensor:             # [T, H] predicted next features
        x = self.fc(torch.cat([features, token_embeds], dim=-1))
        rope = self.rotary.lookup(positions, x.dtype)
        return self.norm(self.layer(rope, x, kv_cache, meta))

    def logits_input(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows ``forward`` returned, as the LM head reads them (here: as they are; an EAGLE-3
        head returns its state beside them)."""
        return rows

    def forward_train(
        self,
        features: torch.Tensor,      # [B, L, H]
        token_embeds: torch.Tensor,  # [B, L, H]
    ) -> torch.Tensor:               # [B, L, H]
        """The same computation over whole padded sequences with causal attention (no KV cache)."""
        x, q, k, v = self._train_qkv(features, token_embeds)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self._train_finish(x, out)

    def forward_train_unrolled(
        self,
        features: torch.Tensor,      # [B, L, H] the target's features
        token_embeds: torch.Tensor,  # [B, L, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # h1, h2: [B, L, H]
        """``h1`` as ``forward_train``; ``h2[:, j]`` is the head's output at position j when
        its input feature is its own ``h1[:, j - 1]``, as when it drafts a second token,
        while positions before j keep the target's features (what its KV cache then
        holds). Training on h2 too is EAGLE's "training-time test": without it the head
        only ever saw the target's features and its second and later drafts are rarely
        accepted."""
        x1, q1, k1, v1 = self._train_qkv(features, token_embeds)
        gqa = q1.shape[1] != k1.shape[1]
        h1 = self._train_finish(x1, F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=gqa))
        own = torch.cat([features[:, :1], h1[:, :-1].detach()], dim=1)   # [B, L, H] position 0 has no prediction
        x2, q2, k2, v2 = self._train_qkv(own, token_embeds)
        return h1, self._train_finish(x2, attend_own_step(q2, k1, v1, k2, v2))

    def _train_qkv(self, features, token_embeds):
        """-> x [B, L, H] (the layer's input), q [B, hq, L, hd], k and v [B, hk, L, hd]."""
        b, length, _ = features.shape
        x = self.fc(torch.cat([features, token_embeds], dim=-1))
        cos, sin = self.rotary.lookup(torch.arange(length, device=x.device), x.dtype)  # [L, 1, hd]
        attn = self.layer.self_attn
        hq, hk, hd = self.config.num_attention_heads, self.config.num_key_value_heads, self.head_dim
        qkv = attn.qkv_proj(self.layer.attn_norm(x))                # [B, L, (hq + 2hk) hd]
        qk, v = qkv.split([(hq + hk) * hd, hk * hd], dim=-1)
        qk = apply_rotary(qk.reshape(b, length, hq + hk, hd), cos, sin)
        q, k = qk.split([hq, hk], dim=2)
        return x, q.transpose(1, 2), k.transpose(1, 2), v.reshape(b, length, hk, hd).transpose(1, 2)

    def _train_finish(self, x, attn_out):
        """x [B, L, H], attn_out [B, hq, L, hd] -> the head's output [B, L, H]."""
        b, hq, length, hd = attn_out.shape
        layer = self.layer
        x = x + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, length, hq * hd))
        x = x + layer.mlp(layer.mlp_norm(x))
        return self.norm(x)


def attend_own_step(q2, k1, v1, k2, v2) -> torch.Tensor:
    """The training-time test's second pass (EAGLE and EAGLE-3 heads): query j of the pass on the
    head's own features (q2, k2, v2 [B, h, L, hd]) sees the first pass's keys (the target's
    features: k1, v1) before j and its own key at j, as its KV cache holds them when drafting."""
    length = q2.shape[2]
    pos = torch.arange(length, device=q2.device)
    mask = torch.cat([pos[None, :] < pos[:, None], pos[None, :] == pos[:, None]], dim=1)  # [L, 2L]
    return F.scaled_dot_product_attention(q2, torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2),
                                          attn_mask=mask, enable_gqa=q2.shape[1] != k1.shape[1])


def _single_tp():
    from specserve.distributed.parallel_state import SINGLE

    return SINGLE


def save_eagle_head(folder: str, head: EagleHead, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    sd = {k: (t.to(dtype) if t.is_floating_point() else t).cpu() for k, t in head.export_weights().items()}
    save_file(sd, os.path.join(folder, EAGLE_WEIGHTS_NAME))
    head.config.save(folder)


def load_eagle_head(folder: str, dtype: torch.dtype, max_positions: int = 8192) -> EagleHead:
    from safetensors.torch import load_file

    if not is_eagle_folder(folder):
        raise ValueError(f"{folder!r} is not an EAGLE head folder (no {EAGLE_CONFIG_NAME})")
    config = EagleConfig.load(folder)
    sd = load_file(os.path.join(folder, EAGLE_WEIGHTS_NAME))
    head = EagleHead(config, max_positions)
    head.load_weights({k: (t.to(dtype) if t.is_floating_point() else t) for k, t in sd.items()})
    return head
