"""Drafts trained for the default target (SmolLM2-135M-Instruct), shipped with specserve.

``smollm2-135m-draft/`` is a small standalone Llama (a Hugging Face folder) and
``smollm2-135m-eagle/`` an EAGLE head; both were made with ``specserve
train-draft`` (see docs/drafts.md). They are used when speculation on the
default target is asked for without naming a draft.
"""
from __future__ import annotations

import os

SHIPPED = {"draft_model": "smollm2-135m-draft", "eagle": "smollm2-135m-eagle"}
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


def is_default_target(model: str | None) -> bool:
    """True for ``None`` (the default model) or a path to the default GGUF file itself."""
    if model is None:
        return True
    from specserve.model_executor.loader import ModelNotFoundError, default_model_path

    try:
        return os.path.abspath(os.path.expanduser(model)) == os.path.abspath(default_model_path())
    except ModelNotFoundError:
        return False


def shipped_draft(method: str, target_model: str | None) -> str:
    """The folder of the shipped draft for ``method``; a clear error for other targets."""
    if method not in SHIPPED:
        raise ValueError(f"there is no shipped draft for speculative method {method!r}")
    if not is_default_target(target_model):
        raise ValueError(
            f"speculative method {method!r} needs a draft (speculative_model=...): specserve ships drafts only "
            f"for the default target ({DEFAULT_TARGET_NAME}), not for {target_model!r}. Train one with "
            f"`specserve train-draft --target {target_model} --method {method} --out DIR` and pass DIR."
        )
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), SHIPPED[method])
    if not os.path.isdir(path):
        raise ValueError(f"the shipped {method} draft is missing from this installation ({path})")
    return path
