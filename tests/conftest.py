"""Shared fixtures: the real default model (loaded once per session) and drafts
built on its vocabulary (a layer-truncated copy of it, saved as a Hugging Face folder)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from specserve.model_executor.loader import load_model


def write_truncated_draft(folder: str, num_layers: int, dtype=torch.float32) -> str:
    """Save the default model cut to its first ``num_layers`` layers as an HF folder."""
    loaded = load_model(None, dtype)
    keep = {
        name: t.contiguous()
        for name, t in loaded.state_dict.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    os.makedirs(folder, exist_ok=True)
    save_file(keep, os.path.join(folder, "model.safetensors"))
    config = loaded.config.to_dict()
    config["num_hidden_layers"] = num_layers
    config["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def truncated_draft_dir(tmp_path_factory) -> str:
    return write_truncated_draft(str(tmp_path_factory.mktemp("draft4")), num_layers=4)
