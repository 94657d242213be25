"""Train an EAGLE-3 head (model_executor/models/eagle3.py) on self-distillation data whose
records hold, per position, the target's final hidden state and the residual stream before the
head's feature layers (``generate_dataset(feature_layers=...)``).

At position t the head reads ``fc`` of the target's features at t and the embedding of
x_{t+1}; its logits should be the target's distribution for x_{t+2}: the loss is
KL(target || head) over the draft vocabulary at the positions whose predicted token is part of
a response (the teacher's logits from the target's final hidden state at t+1 and LM head).
The head starts from the target: its layer is a copy of the target's last (reading embedding
+ feature through the same matrices), ``fc`` picks the highest feature layer, its norm and LM
head rows are the target's. ``unroll_steps=2`` also trains every position on the head's own
previous state (EAGLE's training-time test). The result is saved as vLLM saves EAGLE-3 heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.model_executor.models.eagle3 import Eagle3Head, eagle3_config_for, save_eagle3_head
from specserve.training.train_eagle import _last_layer_as_llama, _plain_norm, head_loss
from specserve.training.trainer import Batch, distill_loss


class Eagle3Task:
    def __init__(self, target_config, target_sd: dict, draft_vocab: torch.Tensor | None,
                 feature_layers: tuple[int, ...], unroll_steps: int = 1):
        config = eagle3_config_for(target_config, len(draft_vocab) if draft_vocab is not None else None,
                                   feature_layers)
        head = Eagle3Head(config, max_positions=4096)
        h, n = config.hidden_size, len(feature_layers)
        layer = {k.removeprefix("layer."): v.float() for k, v in _last_layer_as_llama(target_config, target_sd).items()}
        lm_head = target_sd.get("lm_head.weight", target_sd["model.embed_tokens.weight"]).float()
        rows = draft_vocab if draft_vocab is not None else torch.arange(config.vocab_size)
        sd = {"fc.weight": torch.cat([torch.zeros(h, (n - 1) * h), torch.eye(h)], dim=1),
              "norm.weight": _plain_norm(target_config, target_sd["model.norm.weight"]),
              "lm_head.weight": lm_head[rows],
              "d2t": rows - torch.arange(len(rows)),
              "midlayer.input_layernorm.weight": layer["input_layernorm.weight"],
              "midlayer.hidden_norm.weight": layer["input_layernorm.weight"],
              "midlayer.post_attention_layernorm.weight": layer["post_attention_layernorm.weight"],
              "midlayer.self_attn.o_proj.weight": layer["self_attn.o_proj.weight"],
              "midlayer.mlp.gate_proj.weight": layer["mlp.gate_proj.weight"],
              "midlayer.mlp.up_proj.weight": layer["mlp.up_proj.weight"],
              "midlayer.mlp.down_proj.weight": layer["mlp.down_proj.weight"]}
        for name in "qkv":   # [embedding ; feature] through the same matrix: the layer reads their sum at first
            w = layer[f"self_attn.{name}_proj.weight"]
            sd[f"midlayer.self_attn.{name}_proj.weight"] = torch.cat([w, w], dim=1)
        head.load_weights(sd)
        for param in head.parameters():
            param.requires_grad_(True)
        self.module = head
        self.embed = target_sd["model.embed_tokens.weight"].float()                    # [V, H] frozen
        self.full_lm_head = lm_head                                                    # the teacher's
        self.set_vocab(draft_vocab)
        if unroll_steps not in (1, 2):
            raise ValueError(f"unroll_steps must be 1 or 2, got {unroll_steps}")
        self.unroll_steps = unroll_steps
        self.hidden_size = h

    def set_vocab(self, rows: torch.Tensor | None) -> None:
        """The teacher's LM-head rows the loss compares with (the head's own rows are its draft vocabulary's)."""
        rows = rows.to(self.full_lm_head.device) if rows is not None else None
        self.teacher_lm_head = self.full_lm_head[rows] if rows is not None else self.full_lm_head    # [Vd, H]
        self.vocab_size = self.teacher_lm_head.shape[0]

    def loss(self, batch: Batch):
        h = self.hidden_size
        feats, tokens = batch.features, batch.tokens           # [B, L-1, H + n H], [B, L]
        n = feats.shape[1] - 1
        if n < 1:
            zero = feats.sum() * 0.0
            return zero, {"loss": 0.0, "kl": 0.0, "agree": 0.0, "positions": 0}
        f_in = feats[:, :n, h:]                                # the feature layers' inputs at t
        emb = F.embedding(tokens[:, 1 : n + 1], self.embed)
        teacher = feats[:, 1 : n + 1, :h]                      # the final hidden state at t + 1
        return head_loss(self.module, batch, f_in, emb, teacher, self.unroll_steps, self._position_loss)

    def _position_loss(self, out, teacher, mask):
        student = self.module.logits_input(out)[mask]
        kl, agree = distill_loss(student, teacher[mask], self.module.lm_head.weight, self.teacher_lm_head)
        return kl, {"loss": kl.item(), "kl": kl.item(), "agree": agree.item()}

    def to(self, device) -> "Eagle3Task":
        self.module.to(device)
        self.embed, self.full_lm_head, self.teacher_lm_head = (
            t.to(device) for t in (self.embed, self.full_lm_head, self.teacher_lm_head))
        return self

    def export(self, out_dir: str, training_info: dict) -> None:
        self.module.config.hf["training"] = training_info
        save_eagle3_head(out_dir, self.module, torch.bfloat16)
