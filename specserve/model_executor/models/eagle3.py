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
from torch import nn

from specserve.model_executor.layers.attention import AttentionMetadata
from specserve.model_executor.layers.linear import ColumnParallelLinear
from specserve.model_executor.layers.norm import RMSNorm
from specserve.model_executor.layers.rotary import RotaryEmbedding
from specserve.model_executor.models.decoder import DecoderLayer
from specserve.model_executor.models.decoder_spec import eagle_layer_spec

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class Eagle3Config:
    """The head's shape (the attention's and MLP's are a Llama layer's), from its ``config.json``."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
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
            or (2, target_num_layers // 2, target_num_layers - 3)
        return cls(
            hidden_size=hf["hidden_size"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"],
            feature_layers=tuple(int(i) for i in layers), hf=hf)


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
        rope_config = LlamaConfig(**{k: v for k, v in config.hf.items() if k in (
            "hidden_size", "num_attention_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings")})
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
        return rows[:, : self.config.hidden_size]


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
