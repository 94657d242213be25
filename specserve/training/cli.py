"""``specserve train-draft``: self-distill a draft (small Llama or EAGLE head) for a target.

1. The target answers the prompt set (greedy and sampled) with specserve's
   batched engine; its hidden states are recorded (training/data.py).
2. A draft vocabulary is chosen: the N most frequent tokens the target emitted.
3. The draft is trained to match the target's distributions (training/trainer.py)
   and saved to --out: a Hugging Face folder (draft_model) or an EAGLE folder.

Everything is resumable: data shards already written are reused, and
``--resume`` continues training from the last checkpoint in the work dir.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

logger = logging.getLogger(__name__)


def add_train_draft_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train-draft",
        help="train a draft (small Llama or EAGLE head) for a target by self-distillation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default=None, help="the target: .gguf, HF folder or cached hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", required=True, choices=["draft_model", "eagle", "eagle3"])
    p.add_argument("--out", required=True, help="output folder (HF folder for draft_model, EAGLE folder for eagle)")
    p.add_argument("--work-dir", default=None, help="data and checkpoints (default: OUT/train-work)")
    p.add_argument("--data-dir", default=None, help="generated data, reusable across methods (default: WORK_DIR/data)")
    p.add_argument("--prompts", default=None, help="JSONL prompt file (default: the shipped training prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens generated per answer")
    p.add_argument("--temperatures", default="0,0.8", help="one answer per prompt per temperature (0 = greedy)")
    p.add_argument("--gen-batch-size", type=int, default=64, help="prompts per generation batch (= per data shard)")
    p.add_argument("--gen-dtype", default="float32", help="the target's dtype while generating")
    p.add_argument("--max-gen-minutes", type=float, default=None, help="stop generating after this long (resumable)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per training batch")
    p.add_argument("--max-len", type=int, default=512, help="truncate sequences to this many tokens")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="LM-head rows used by the loss (and by an EAGLE head when drafting): the most frequent target "
                        "tokens; 0 = the whole vocabulary")
    p.add_argument("--num-layers", type=int, default=2, help="draft_model: decoder layers")
    p.add_argument("--hidden-size", type=int, default=None, help="draft_model: width (default and max: the target's)")
    p.add_argument("--intermediate-size", type=int, default=None, help="draft_model: MLP width (default: scaled from the target)")
    p.add_argument("--init", default="target", choices=["target", "random"], help="draft_model: start layers from the target's first layers")
    p.add_argument("--reg-weight", type=float, default=1.0, help="eagle: feature regression (smooth L1) weight")
    p.add_argument("--kl-weight", type=float, default=1.0, help="eagle: distribution (KL) weight")
    p.add_argument("--feature-noise", type=float, default=0.0, help="eagle: uniform noise width added to input features")
    p.add_argument("--unroll-steps", type=int, default=1, choices=[1, 2],
                   help="eagle, eagle3: 2 also trains each position on the head's own previous output, as when it "
                        "drafts a second token (EAGLE's training-time test; about 2x the training time)")
    p.add_argument("--feature-layers", default=None, metavar="I,J,K",
                   help="eagle3: the target layers whose inputs the head reads (default: vLLM's 2, L/2, L-3)")
    p.add_argument("--max-train-minutes", type=float, default=None, help="stop training after this long (resumable)")
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue training from WORK_DIR/checkpoint.pt")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is best on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="measure where training time goes before training")
    p.set_defaults(func=cmd_train_draft)
    return p


def cmd_train_draft(args) -> int:
    import torch

    from specserve.model_executor.loader import load_model
    from specserve.training.data import choose_draft_vocab, generate_dataset, load_dataset
    from specserve.training.prompts import load_prompts
    from specserve.training.trainer import TrainConfig, profile_loss, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work_dir = args.work_dir or os.path.join(args.out, "train-work")
    data_dir = args.data_dir or os.path.join(work_dir, "data")
    temperatures = tuple(float(t) for t in args.temperatures.split(",") if t.strip())
    prompts = load_prompts(args.prompts, args.num_prompts)
    feature_layers: tuple[int, ...] = ()
    if args.method == "eagle3":
        from specserve.model_executor.models.eagle3 import default_feature_layers

        layers = load_model(args.target, torch.float32, load_weights=False).config.num_hidden_layers
        feature_layers = (tuple(int(i) for i in args.feature_layers.split(",")) if args.feature_layers
                          else default_feature_layers(layers))
    t0 = time.monotonic()
    meta = generate_dataset(
        args.target, prompts, data_dir, max_tokens=args.max_tokens, temperatures=temperatures,
        batch_size=args.gen_batch_size, dtype=args.gen_dtype, device=device, seed=args.seed,
        max_minutes=args.max_gen_minutes, feature_layers=feature_layers,
    )
    gen_minutes = (time.monotonic() - t0) / 60
    records = load_dataset(data_dir)
    response_tokens = sum(len(r["tokens"]) - r["prompt_len"] for r in records)
    print(f"data: {len(records)} answers, {response_tokens} generated tokens in {data_dir} "
          f"({gen_minutes:.1f} min this run)")

    loaded = load_model(args.target, torch.float32)
    if loaded.config.hidden_size != meta["hidden_size"] or loaded.config.vocab_size != meta["vocab_size"]:
        raise ValueError(f"the data in {data_dir} was generated by another target ({meta['target']})")
    vocab, coverage = choose_draft_vocab(records, loaded.config.vocab_size, args.draft_vocab_size)
    print(f"draft vocabulary: {len(vocab) if vocab is not None else loaded.config.vocab_size} tokens, "
          f"covering {coverage:.1%} of the generated tokens")
    if args.method == "eagle":
        from specserve.training.train_eagle import EagleTask

        task = EagleTask(loaded.config, loaded.state_dict, vocab, loaded.name, args.reg_weight, args.kl_weight,
                         args.feature_noise, args.unroll_steps)
    elif args.method == "eagle3":
        from specserve.training.train_eagle3 import Eagle3Task

        task = Eagle3Task(loaded.config, loaded.state_dict, vocab, feature_layers, args.unroll_steps)
    else:
        from specserve.training.train_draft_model import DraftModelTask

        task = DraftModelTask(loaded.config, loaded.state_dict, vocab, args.num_layers, args.hidden_size,
                              args.intermediate_size, args.init)
    task.to(device)
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens, max_len=args.max_len,
                      seed=args.seed, save_every=args.save_every, max_minutes=args.max_train_minutes, device=device)
    profile = None
    if args.profile:
        profile = profile_loss(task, records, cfg, vocab)
        print("profile (forward + backward, seconds per 1k loss positions):", json.dumps(profile))
    t1 = time.monotonic()
    result = train(task, records, cfg, work_dir, args.resume)
    info = {
        "target": loaded.name,
        "method": args.method,
        "data": {"answers": len(records), "generated_tokens": response_tokens, "prompts": len(prompts),
                 "max_tokens": args.max_tokens, "temperatures": list(temperatures)},
        "draft_vocab_size": len(vocab) if vocab is not None else loaded.config.vocab_size,
        "draft_vocab_coverage": round(coverage, 4),
        "epochs": args.epochs, "lr": args.lr, "batch_tokens": args.batch_tokens,
        **({"unroll_steps": args.unroll_steps} if args.method in ("eagle", "eagle3") else {}),
        **({"feature_layers": list(feature_layers)} if feature_layers else {}),
        "train_minutes": round((time.monotonic() - t1) / 60, 2),
        "history": result["history"], "best_epoch": result["best_epoch"], "complete": result["complete"],
    }
    if profile:
        info["profile"] = profile
    os.makedirs(args.out, exist_ok=True)
    if args.method in ("eagle", "eagle3"):
        task.export(args.out, info)
    else:
        task.export(args.out, loaded.tokenizer, info)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(info, f, indent=2)
    hist = {h["epoch"]: h for h in result["history"]}
    last = hist.get(result["best_epoch"], result["history"][-1] if result["history"] else {})
    print(f"saved {args.method} draft to {args.out} "
          f"(held-out top-1 agreement with the target: {last.get('eval_agree', float('nan')):.3f}; "
          f"{'complete' if result['complete'] else 'stopped early: rerun with --resume'})")
    return 0
