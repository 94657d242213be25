"""Train a small standalone draft: a Llama with the target's tokenizer, saved as a plain HF folder.

The draft is ``num_layers`` Llama layers of width ``hidden_size`` (at most the
target's) with tied embeddings. It starts from the target where that helps:

- embeddings: the target's, projected onto their top ``hidden_size`` principal
  directions (``E @ P``; ``P`` = the identity at the target's width), frozen, so the
  tied LM head gives nearly the target's logits for a hidden state in that subspace;
- layers: the target's first layers, projected the same way (``W_q P``,
  ``P.T W_o``...; at full width an exact copy), keeping the first heads / MLP rows
  when the draft has fewer;
- final norm: the target's, projected.

It is trained on the target's distributions (KL over the draft vocabulary, from
the recorded hidden states) at every response position, and saved with
``save_pretrained`` in bf16 next to the target's tokenizer, so both
``LLM(speculative_model=DIR)`` and transformers' ``assistant_model`` load it.
"""
from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.model_executor.layers.rotary import rope_theta_of
from specserve.training.trainer import Batch, distill_loss


def draft_config(target_config, num_layers: int, hidden_size: int | None, intermediate_size: int | None) -> LlamaConfig:
    big = target_config.hidden_size
    d = min(hidden_size or big, big)
    heads_t = target_config.num_attention_heads
    head_dim = getattr(target_config, "head_dim", None) or big // heads_t
    if d % head_dim:
        raise ValueError(f"the draft's hidden size {d} must be a multiple of the target's head_dim {head_dim}")
    heads = d // head_dim
    group = max(1, heads_t // target_config.num_key_value_heads)   # query heads per KV head, as the target
    kv = max(1, heads // group)
    while heads % kv:
        kv -= 1
    inter = intermediate_size or max(head_dim, round(target_config.intermediate_size * d / big / 64) * 64)
    theta = rope_theta_of(target_config)
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=d,
        intermediate_size=inter,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=getattr(target_config, "max_position_embeddings", 8192),
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=theta,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=True,
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
        pad_token_id=getattr(target_config, "pad_token_id", None),
        hidden_act="silu",
        architectures=["LlamaForCausalLM"],
    )


def _projection(embed: torch.Tensor, d: int) -> torch.Tensor:
    """[H, d]: the top-d right singular vectors of the embedding matrix (identity when d == H)."""
    h = embed.shape[1]
    if d == h:
        return torch.eye(h)
    _, _, vt = torch.linalg.svd(embed, full_matrices=False)
    return vt[:d].T.contiguous()


class DraftModelTask:
    def __init__(self, target_config, target_sd: dict, draft_vocab: torch.Tensor | None, num_layers: int = 2,
                 hidden_size: int | None = None, intermediate_size: int | None = None, init: str = "target"):
        cfg = draft_config(target_config, num_layers, hidden_size, intermediate_size)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).float()
        embed = target_sd["model.embed_tokens.weight"].float()
        proj = _projection(embed, cfg.hidden_size)                                      # [H, d]
        sq = proj.pow(2)                                                                 # projects a norm's gains
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(embed @ proj)
            model.model.norm.weight.copy_(sq.T @ target_sd["model.norm.weight"].float())
            if init == "target":
                self._init_layers(model, cfg, target_config, target_sd, proj, sq)
        model.model.embed_tokens.weight.requires_grad_(False)   # frozen (and tied: the LM head too)
        self.module = model
        self.config = cfg
        self.full_target_head = target_sd.get("lm_head.weight", embed).float()          # [V, H]
        self.set_vocab(draft_vocab)

    @staticmethod
    def _init_layers(model, cfg, target_config, sd, proj, sq) -> None:
        hd = cfg.head_dim
        q_rows, kv_rows, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
        for i, layer in enumerate(model.model.layers):
            if i >= target_config.num_hidden_layers:
                break
            p = f"model.layers.{i}."
            w = lambda n: sd[p + n].float()  # noqa: E731
            a, m = layer.self_attn, layer.mlp
            a.q_proj.weight.copy_(w("self_attn.q_proj.weight")[:q_rows] @ proj)
            a.k_proj.weight.copy_(w("self_attn.k_proj.weight")[:kv_rows] @ proj)
            a.v_proj.weight.copy_(w("self_attn.v_proj.weight")[:kv_rows] @ proj)
            a.o_proj.weight.copy_(proj.T @ w("self_attn.o_proj.weight")[:, :q_rows])
            m.gate_proj.weight.copy_(w("mlp.gate_proj.weight")[:inter] @ proj)
            m.up_proj.weight.copy_(w("mlp.up_proj.weight")[:inter] @ proj)
            m.down_proj.weight.copy_(proj.T @ w("mlp.down_proj.weight")[:, :inter])
            layer.input_layernorm.weight.copy_(sq.T @ w("input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(sq.T @ w("post_attention_layernorm.weight"))

    def set_vocab(self, rows: torch.Tensor | None) -> None:
        """Which vocabulary rows the loss uses (None: all)."""
        student = self.module.model.embed_tokens.weight.detach()
        rows = rows.to(student.device) if rows is not None else None
        self.lm_head = student[rows] if rows is not None else student                    # [Vd, d]
        self.teacher_head = self.full_target_head[rows.to(self.full_target_head.device)] if rows is not None else self.full_target_head
        self.vocab_size = self.lm_head.shape[0]

    def loss(self, batch: Batch):
        tokens, feats = batch.tokens, batch.features             # [B, L], [B, L-1, H]
        n = feats.shape[1]                                       # positions t = 0 .. L-2 predict x_{t+1}
        hidden = self.module.model(input_ids=tokens[:, :n]).last_hidden_state  # [B, n, d] (causal; pads at the end)
        t = torch.arange(n, device=tokens.device)[None, :]
        mask = (t >= (batch.prompt_lens[:, None] - 1)) & (t < (batch.lengths[:, None] - 1))
        kl, agree = distill_loss(hidden[mask], feats[mask], self.lm_head, self.teacher_head)
        return kl, {"loss": kl.item(), "kl": kl.item(), "agree": agree.item(), "positions": int(mask.sum())}

    def to(self, device) -> "DraftModelTask":
        self.module.to(device)
        self.full_target_head = self.full_target_head.to(device)
        self.lm_head, self.teacher_head = self.lm_head.to(device), self.teacher_head.to(device)
        return self

    def export(self, out_dir: str, tokenizer, training_info: dict) -> None:
        model = copy.deepcopy(self.module).to("cpu", torch.bfloat16)
        model.config.specserve_training = training_info
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
