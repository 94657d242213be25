"""The training loop shared by both draft kinds: batches, loss, checkpoints, time budget.

The loss is distillation from the target's own distribution, restricted to a
draft vocabulary (the N most frequent tokens of the target's generations):
``KL(softmax(f @ W_d.T) || softmax(s @ W_d.T))`` where ``f`` is the target's
recorded hidden state, ``s`` the draft's and ``W_d`` the LM head's rows for the
draft vocabulary. Why a reduced vocabulary: the target's 49k-row LM head, run
forward for the teacher and forward + backward for the student on every
position, costs more than the draft's layers themselves; 8k rows cover ~98% of
what the target says and cut that cost 6x (``--profile`` measures it).

A task (EAGLE head or draft model) supplies the trainable module and turns a
batch into (student hidden, teacher hidden, mask); everything else is here.
"""
from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class Batch:
    tokens: torch.Tensor       # [B, L] int64, right-padded with 0
    features: torch.Tensor     # [B, L - 1, H] fp32 target hidden states (0-padded)
    prompt_lens: torch.Tensor  # [B]
    lengths: torch.Tensor      # [B] real token counts

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.tokens, self.features, self.prompt_lens, self.lengths)))


def split_records(records: list[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """A deterministic held-out split (at least one record each side when possible)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_eval = min(len(records) - 1, max(1, round(len(records) * eval_fraction))) if len(records) > 1 else 0
    ev = [records[i] for i in order[:n_eval]]
    tr = [records[i] for i in order[n_eval:]]
    return tr, ev


def make_batches(records: list[dict], batch_tokens: int, max_len: int, seed: int | None) -> list[list[int]]:
    """Groups of record indices of similar length, each at most ``batch_tokens`` padded tokens.

    With a seed the order of the groups (and what falls into them) is shuffled.
    """
    lengths = [min(len(r["tokens"]), max_len) for r in records]
    order = sorted(range(len(records)), key=lambda i: lengths[i])
    if seed is not None:  # jitter lengths so groups differ from epoch to epoch
        rng = random.Random(seed)
        order = sorted(order, key=lambda i: lengths[i] + rng.random() * 16)
    groups, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        groups.append(cur)
    if seed is not None:
        random.Random(seed + 1).shuffle(groups)
    return groups


def collate(records: list[dict], max_len: int) -> Batch:
    lengths = [min(len(r["tokens"]), max_len) for r in records]
    width = max(lengths)
    hidden = records[0]["features"].shape[1]
    tokens = torch.zeros(len(records), width, dtype=torch.long)
    features = torch.zeros(len(records), width - 1, hidden)
    for b, (r, n) in enumerate(zip(records, lengths)):
        tokens[b, :n] = r["tokens"][:n].long()
        features[b, : n - 1] = r["features"][: n - 1].float()
    return Batch(tokens, features, torch.tensor([r["prompt_len"] for r in records]), torch.tensor(lengths))


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, lm_head: torch.Tensor,
                 teacher_lm_head: torch.Tensor | None = None):
    """student, teacher [N, H] hidden states -> (KL(teacher || student), top-1 agreement).

    lm_head [Vd, H] are the draft-vocabulary rows of the LM head that maps the student's
    hidden states to logits; ``teacher_lm_head`` the target's rows for the same tokens
    (default: the same matrix, as for an EAGLE head).
    """
    t_head = lm_head if teacher_lm_head is None else teacher_lm_head
    with torch.no_grad():
        t_logp = F.log_softmax(teacher @ t_head.T, dim=-1)                  # [N, Vd]
    s_logits = student @ lm_head.T                                           # [N, Vd]
    s_logp = F.log_softmax(s_logits, dim=-1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
    agree = (s_logits.argmax(-1) == t_logp.argmax(-1)).float().mean()
    return kl, agree


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class TrainConfig:
    epochs: int = 2
    lr: float = 1e-3
    batch_tokens: int = 4096
    max_len: int = 512
    eval_fraction: float = 0.05
    seed: int = 0
    save_every: int = 50           # steps between checkpoints
    max_minutes: float | None = None
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    device: str = "cpu"


def evaluate(task, records: list[dict], cfg: TrainConfig) -> dict:
    if not records:
        return {}
    total: dict[str, float] = {}
    n = 0
    with torch.no_grad():
        for group in make_batches(records, cfg.batch_tokens, cfg.max_len, None):
            batch = collate([records[i] for i in group], cfg.max_len).to(cfg.device)
            loss, m = task.loss(batch)
            w = m["positions"]
            for k, v in m.items():
                if k != "positions":
                    total[k] = total.get(k, 0.0) + v * w
            n += w
    return {k: v / max(1, n) for k, v in total.items()}


def train(task, records: list[dict], cfg: TrainConfig, work_dir: str, resume: bool) -> dict:
    """Run (or resume) training; returns the final metrics. The task exports the result itself."""
    os.makedirs(work_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    train_records, eval_records = split_records(records, cfg.eval_fraction, cfg.seed)
    params = [p for p in task.module.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = len(make_batches(train_records, cfg.batch_tokens, cfg.max_len, cfg.seed))
    total_steps = per_epoch * cfg.epochs
    warmup = max(1, total_steps // 20)
    epoch, batch_index, step, history = 0, 0, 0, []
    ckpt_path = os.path.join(work_dir, CHECKPOINT_FILE)
    if resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=False, map_location=cfg.device)
        task.module.load_state_dict(ckpt["module"])
        optim.load_state_dict(ckpt["optim"])
        epoch, batch_index, step, history = ckpt["epoch"], ckpt["batch_index"], ckpt["step"], ckpt["history"]
        logger.info("resumed from %s at epoch %d, batch %d", ckpt_path, epoch, batch_index)

    def save() -> None:
        tmp = ckpt_path + ".tmp"
        torch.save({"module": task.module.state_dict(), "optim": optim.state_dict(), "epoch": epoch,
                    "batch_index": batch_index, "step": step, "history": history}, tmp)
        os.replace(tmp, ckpt_path)

    started = time.monotonic()
    out_of_time = False
    best = None
    bar = tqdm(total=total_steps, initial=step, desc="Training", unit="step")
    while epoch < cfg.epochs and not out_of_time:
        groups = make_batches(train_records, cfg.batch_tokens, cfg.max_len, cfg.seed + epoch)
        run = {"loss": 0.0, "kl": 0.0, "agree": 0.0, "n": 0}
        task.module.train()
        while batch_index < len(groups):
            if cfg.max_minutes is not None and time.monotonic() - started > cfg.max_minutes * 60:
                out_of_time = True
                break
            batch = collate([train_records[i] for i in groups[batch_index]], cfg.max_len).to(cfg.device)
            for g in optim.param_groups:
                g["lr"] = lr_at(step, total_steps, cfg.lr, warmup)
            loss, m = task.loss(batch)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optim.step()
            step += 1
            batch_index += 1
            for k in ("loss", "kl", "agree"):
                run[k] += m[k]
            run["n"] += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{run['loss'] / run['n']:.3f}", agree=f"{run['agree'] / run['n']:.3f}")
            if step % cfg.save_every == 0:
                save()
        if out_of_time:
            break
        task.module.eval()
        ev = evaluate(task, eval_records, cfg)
        n = max(1, run["n"])
        history.append({"epoch": epoch, "train_loss": run["loss"] / n, "train_agree": run["agree"] / n,
                        **{f"eval_{k}": v for k, v in ev.items()}})
        logger.info("epoch %d: %s", epoch, history[-1])
        score = ev.get("agree", -epoch)
        if best is None or score > best[0]:  # keep the epoch that agrees with the target best on held-out data
            best = (score, epoch, {k: v.detach().clone() for k, v in task.module.state_dict().items()})
        tqdm.write(f"epoch {epoch}: " + ", ".join(f"{k}={v:.4f}" for k, v in history[-1].items() if k != "epoch"))
        epoch += 1
        batch_index = 0
        save()
    bar.close()
    if out_of_time:
        save()
        tqdm.write(f"stopped after {cfg.max_minutes} minutes at epoch {epoch}, batch {batch_index}; "
                   "--resume continues from here")
    task.module.eval()
    best_epoch = None
    if best is not None and not out_of_time:
        task.module.load_state_dict(best[2])
        best_epoch = best[1]
    return {"history": history, "best_epoch": best_epoch, "steps": step, "complete": not out_of_time,
            "train_minutes_this_run": round((time.monotonic() - started) / 60, 2),
            "train_records": len(train_records), "eval_records": len(eval_records),
            "train_tokens": sum(len(r["tokens"]) - r["prompt_len"] for r in train_records)}


def profile_loss(task, records: list[dict], cfg: TrainConfig, draft_vocab: torch.Tensor | None, steps: int = 2) -> dict:
    """Seconds per 1k loss positions of forward + backward: draft vocabulary, full vocabulary, no LM head.

    "no LM head" uses a 2-row head, so it measures the draft's own layers; the
    difference to the others is what the LM head in the loss costs.
    """
    groups = make_batches(records, cfg.batch_tokens, cfg.max_len, None)[:steps]
    out = {}
    for name, rows in (("draft_vocab", draft_vocab), ("full_vocab", None), ("no_lm_head", torch.arange(2))):
        task.set_vocab(rows)
        elapsed, positions = 0.0, 0
        for g in groups:
            batch = collate([records[i] for i in g], cfg.max_len).to(cfg.device)
            t0 = time.perf_counter()
            loss, m = task.loss(batch)
            loss.backward()
            elapsed += time.perf_counter() - t0
            positions += m["positions"]
        task.module.zero_grad(set_to_none=True)
        out[name] = {"lm_head_rows": task.vocab_size, "s_per_1k_positions": round(1000 * elapsed / max(1, positions), 3)}
    task.set_vocab(draft_vocab)
    return out
