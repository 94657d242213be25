"""Tiny random-weight models the fast tests build: a folder in seconds, no download."""
from __future__ import annotations

import torch

from specserve.model_executor.loader import load_model


def write_tiny_llama(folder: str, seed: int, tokenizer=None, embedding_scale: float = 1.0) -> str:
    """A 2-layer, width-64 random Llama with ``tokenizer`` (default: the default model's): loads in a second.

    Its logits are small (a near-uniform next token over the 49k vocabulary); ``embedding_scale``
    multiplies the tied embedding, hence the logits (the final norm sees the same direction), so
    a scale of about 8 gives a model that repeats itself often enough for n-gram lookup to hit
    while still sampling (top token ~0.25 at temperature 0.9)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tokenizer is None:
        tokenizer = load_model(None, torch.float32, load_weights=False).tokenizer
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
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
