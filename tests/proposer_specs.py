"""Every proposer on the tiny models, for the tests that check a request field keeps plain
decoding's tokens under speculation (min_tokens, allowed_token_ids, bad_words, prompt
logprobs): n-gram lookup, the draft model as a chain and as a tree, and EAGLE, each at k = 3."""
from __future__ import annotations

from specserve import LLM

PROPOSERS = ["ngram", "draft_model", "draft_tree", "eagle"]


def proposer_config(name: str, draft_dir: str, eagle_dir: str) -> dict:
    """The speculative_config of proposer ``name`` (``PROPOSERS``)."""
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},
        "draft_model": {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3},
        "draft_tree": {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3, "tree": "2/5"},
        "eagle": {"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 3},
    }[name]


def tiny_engine(model_dir: str, spec: dict | None = None, **kw) -> LLM:
    """A float32 engine of a tiny model (max_model_len 128, 8 MiB of KV cache unless ``kw`` says
    otherwise), speculating by ``spec`` when given."""
    kw = {"max_model_len": 128, "kv_cache_memory": 8 << 20, **kw}
    return LLM(model=model_dir, dtype="float32", **({"speculative_config": spec} if spec else {}), **kw)
