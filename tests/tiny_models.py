"""Tiny random-weight models the fast tests build: a folder in seconds, no download."""
from __future__ import annotations

import torch

from specserve.model_executor.loader import load_model


def write_tiny_eagle(folder: str, target_dir: str, seed: int = 2, exact: bool = False) -> str:
    """An EAGLE head made from the target's last layer (``target_dir``: a tiny model's folder).

    By default its fc is nudged so that its drafts depend on both of its inputs (as in
    tests/spec_decode/test_eagle.py), and its draft vocabulary is every 7th token: it guesses
    poorly. ``exact``: for a one-layer target, a head that IS the target (its layer over the
    next tokens' embeddings, the features ignored, the full vocabulary): its drafts are the
    target's own greedy choices, so they are accepted."""
    from specserve.training.train_eagle import EagleTask

    loaded = load_model(target_dir, torch.float32)
    vocab = None if exact else torch.arange(0, len(loaded.tokenizer), 7)
    task = EagleTask(loaded.config, loaded.state_dict, vocab, "tiny")
    with torch.no_grad():
        fc = task.module.fc.weight                                              # [H, 2H]: [features, embeddings]
        if exact:
            assert loaded.config.num_hidden_layers == 1, "an exact head copies a one-layer target"
            fc[:, : fc.shape[0]] = 0
        else:
            torch.manual_seed(seed)
            fc.add_(0.3 * torch.randn_like(fc))
    task.export(folder, {})
    return folder


def write_tiny_llama(folder: str, seed: int, tokenizer=None, embedding_scale: float = 1.0, num_layers: int = 2) -> str:
    """A ``num_layers``-layer (2), width-64 random Llama with ``tokenizer`` (default: the default model's): loads in a second.

    Its logits are small (a near-uniform next token over the 49k vocabulary); ``embedding_scale``
    multiplies the tied embedding, hence the logits (the final norm sees the same direction), so
    a scale of about 8 gives a model that repeats itself often enough for n-gram lookup to hit
    while still sampling (top token ~0.25 at temperature 0.9)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tokenizer is None:
        tokenizer = load_model(None, torch.float32, load_weights=False).tokenizer
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embedding_scale)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
