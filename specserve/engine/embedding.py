"""Embeddings: a prompt's final hidden states (after the last norm) pooled into one vector, as
llama-server's ``--embeddings`` and vLLM's pooling runner give them for a generative model.

Pooling (``EngineConfig.pooling``, per call too): ``last`` (the last token's state: what a causal
model has seen the whole prompt at; vLLM's default for decoder models), ``mean`` (every token's,
averaged; llama-server's default), ``cls`` (the first token's). Normalized to unit length by default
(OpenAI's and vLLM's embeddings are), so a dot product is the cosine similarity.

The prompt runs outside the scheduler, between two engine steps: its K/V goes to blocks of its own,
freed at once and never cached, in chunks of ``max_num_batched_tokens``. It never changes another
request's output; they wait for it as for a prefill. ``EmbeddingNoRoomError``: the KV cache has no
room for it now (the server tries again after the next step).
"""
from __future__ import annotations

import torch

from specserve.worker.model_runner import ForwardInput

POOLINGS = ("last", "mean", "cls")


class EmbeddingNoRoomError(RuntimeError):
    """No free KV blocks for the prompt now (running requests hold them)."""


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    return pooling


def embed_prompt(runner, kv_cache, request_id: str, token_ids: list[int], pooling: str, normalize: bool,
                 chunk: int, lora_id: int = 0) -> torch.Tensor:
    """``token_ids``' pooled final hidden state [hidden] float32 (on the host)."""
    if not kv_cache.allocate_slots(request_id, len(token_ids)):
        kv_cache.free(request_id)
        raise EmbeddingNoRoomError(f"no KV cache room for a {len(token_ids)}-token prompt now")
    width = runner.config.hidden_size
    total = torch.zeros(width, dtype=torch.float32)
    first = last = None
    try:
        table = kv_cache.block_table(request_id)
        for start in range(0, len(token_ids), chunk):
            piece = token_ids[start : start + chunk]
            out = runner.execute([ForwardInput(piece, start, table, 0, lora_id=lora_id)], return_all_hidden=True)
            hidden = out.all_hidden[:, :width].float().cpu()            # [len(piece), hidden]
            first = hidden[0] if first is None else first
            last = hidden[-1]
            total += hidden.sum(dim=0)
    finally:
        kv_cache.free(request_id)
    vector = {"last": last, "cls": first, "mean": total / len(token_ids)}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
