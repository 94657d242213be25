"""Train an EAGLE head (model_executor/models/eagle.py) on self-distillation data.

At head position t the input is ``(f_t, x_{t+1})`` and the output ``h_t`` should
be the target's ``f_{t+1}``: the loss is ``reg_weight * smoothL1(h_t, f_{t+1})
+ kl_weight * KL(target || head)`` over the draft vocabulary, at the positions
whose predicted token is part of a response. The decoder layer starts as a copy
of the target's last layer, the norm as the target's final norm, and ``fc`` as
``[I | I]`` (feature + embedding), so training starts from something that
already reads the target's residual stream; the embedding and LM head are the
target's, frozen. With ``unroll_steps=2`` every position is also trained with
the head's own previous output as its feature (``forward_train_unrolled``),
which is what it sees when drafting a second or later token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.model_executor.models.decoder_spec import spec_for
from specserve.model_executor.models.eagle import EagleConfig, EagleHead, save_eagle_head
from specserve.training.trainer import Batch, distill_loss


def _plain_norm(target_config, weight: torch.Tensor) -> torch.Tensor:
    """A target norm's weight as the head's plain RMSNorm takes it (Gemma's norms multiply by 1 + w)."""
    return weight.float() + spec_for(target_config).norm_offset


def _last_layer_as_llama(target_config, target_sd: dict) -> dict[str, torch.Tensor]:
    """The head's one Llama layer, started from the target's last layer (what EAGLE does):
    its matrices, and its norms before attention and before the MLP where the family has them
    (else ones). Whatever a Llama layer lacks (biases, q/k norms, norms on the branch outputs)
    is left out: the head is trained from there."""
    p = f"model.layers.{target_config.num_hidden_layers - 1}."
    heads, kv_heads = target_config.num_attention_heads, target_config.num_key_value_heads
    hd = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
    out = {}
    if f"{p}self_attn.qkv_proj.weight" in target_sd:   # Phi-3's fused matrices
        q, k, v = target_sd[f"{p}self_attn.qkv_proj.weight"].split([heads * hd, kv_heads * hd, kv_heads * hd])
        gate, up = target_sd[f"{p}mlp.gate_up_proj.weight"].chunk(2)
        out.update({"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
                    "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
    else:
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            out[f"{name}.weight"] = target_sd[f"{p}{name}.weight"]
    out["self_attn.o_proj.weight"] = target_sd[f"{p}self_attn.o_proj.weight"]
    out["mlp.down_proj.weight"] = target_sd[f"{p}mlp.down_proj.weight"]
    ones = torch.ones(target_config.hidden_size)
    pre_mlp = "post_attention_layernorm" if f"{p}pre_feedforward_layernorm.weight" not in target_sd and \
        f"{p}input_layernorm.weight" in target_sd else "pre_feedforward_layernorm"
    for head_name, target_name in (("input_layernorm", "input_layernorm"), ("post_attention_layernorm", pre_mlp)):
        weight = target_sd.get(f"{p}{target_name}.weight")
        out[head_name + ".weight"] = ones if weight is None else _plain_norm(target_config, weight)
    return {"layer." + k: v for k, v in out.items()}


def head_loss(module, batch: Batch, f_in, emb, target, unroll_steps: int, position_loss):
    """An EAGLE-style head's loss over a batch (EAGLE and EAGLE-3 alike): its output at head
    position t (``f_in`` [B, n, F] and ``emb`` [B, n, H] in) against ``target`` [B, n, ...] by
    ``position_loss(out, target, mask)``, at the positions whose predicted token is part of a
    response; with ``unroll_steps`` 2 also the pass on the head's own previous output
    (``forward_train_unrolled``; position 0 has no own feature)."""
    n = f_in.shape[1]
    t = torch.arange(n, device=f_in.device)[None, :]
    mask = (t >= (batch.prompt_lens[:, None] - 2)) & (t < (batch.lengths[:, None] - 2))
    if unroll_steps == 1:
        loss, metrics = position_loss(module.forward_train(f_in, emb), target, mask)
        return loss, {**metrics, "positions": int(mask.sum())}
    out1, out2 = module.forward_train_unrolled(f_in, emb)
    loss1, m1 = position_loss(out1, target, mask)
    loss2, m2 = position_loss(out2, target, mask & (t >= 1))
    loss = loss1 + loss2
    return loss, {"loss": loss.item(), "kl": m1["kl"], "agree": m1["agree"], "agree2": m2["agree"],
                  "positions": int(mask.sum())}


class EagleTask:
    def __init__(self, target_config, target_sd: dict, draft_vocab: torch.Tensor | None, target_name: str,
                 reg_weight: float = 1.0, kl_weight: float = 1.0, feature_noise: float = 0.0,
                 unroll_steps: int = 1):
        config = EagleConfig.from_target(
            target_config, len(draft_vocab) if draft_vocab is not None else None, target_name
        )
        head = EagleHead(config, max_positions=4096)
        h = config.hidden_size
        sd = {"fc.weight": torch.cat([torch.eye(h), torch.eye(h)], dim=1),
              "norm.weight": _plain_norm(target_config, target_sd["model.norm.weight"])}
        sd.update(_last_layer_as_llama(target_config, target_sd))
        if draft_vocab is not None:
            sd["draft_vocab"] = draft_vocab
        head.load_weights({k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()})
        for param in head.parameters():
            param.requires_grad_(True)
        self.module = head
        self.embed = target_sd["model.embed_tokens.weight"].float()                       # [V, H] frozen
        self.full_lm_head = target_sd.get("lm_head.weight", target_sd["model.embed_tokens.weight"]).float()
        self.set_vocab(draft_vocab)
        self.reg_weight = reg_weight
        self.kl_weight = kl_weight
        self.feature_noise = feature_noise
        if unroll_steps not in (1, 2):
            raise ValueError(f"unroll_steps must be 1 or 2, got {unroll_steps}")
        self.unroll_steps = unroll_steps

    def set_vocab(self, rows: torch.Tensor | None) -> None:
        """Which LM-head rows the loss uses (None: all)."""
        rows = rows.to(self.full_lm_head.device) if rows is not None else None
        self.lm_head = self.full_lm_head[rows] if rows is not None else self.full_lm_head  # [Vd, H]
        self.vocab_size = self.lm_head.shape[0]

    def loss(self, batch: Batch):
        feats, tokens = batch.features, batch.tokens           # [B, L-1, H], [B, L]
        n = feats.shape[1] - 1                                 # head positions t = 0 .. L-3
        if n < 1:
            zero = feats.sum() * 0.0
            return zero, {"loss": 0.0, "kl": 0.0, "agree": 0.0, "positions": 0}
        f_in = feats[:, :n]
        if self.feature_noise and self.module.training:
            f_in = f_in + self.feature_noise * (torch.rand_like(f_in) - 0.5)
        emb = F.embedding(tokens[:, 1 : n + 1], self.embed)
        return head_loss(self.module, batch, f_in, emb, feats[:, 1 : n + 1], self.unroll_steps, self._position_loss)

    def _position_loss(self, h, target, mask):
        hs, ts = h[mask], target[mask]
        reg = F.smooth_l1_loss(hs, ts)
        kl, agree = distill_loss(hs, ts, self.lm_head)
        loss = self.reg_weight * reg + self.kl_weight * kl
        return loss, {"loss": loss.item(), "kl": kl.item(), "agree": agree.item()}

    def to(self, device) -> "EagleTask":
        self.module.to(device)
        self.embed, self.full_lm_head, self.lm_head = (t.to(device) for t in (self.embed, self.full_lm_head, self.lm_head))
        return self

    def export(self, out_dir: str, training_info: dict) -> None:
        self.module.config.training = training_info
        save_eagle_head(out_dir, self.module, torch.bfloat16)
