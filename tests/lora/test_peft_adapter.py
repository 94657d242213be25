"""PEFT adapter folders read and checked (lora/peft_adapter.py): the scale PEFT applies folded into B
(lora_alpha / r, rsLoRA's alpha / sqrt(r), rank and alpha patterns), .bin as .safetensors, and every
adapter specserve cannot run refused by name; LoRARequest's checks."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.lora.peft_adapter import LoraAdapterError, load_peft_adapter
from specserve.lora.request import LoRARequest
from specserve.model_executor.loader import load_model

from lora_adapters import write_peft_adapter


@pytest.fixture(scope="module")
def config(tiny_llama_dir):
    return load_model(tiny_llama_dir, torch.float32, load_weights=False).config


@pytest.fixture(scope="module")
def patterned(tmp_path_factory, tiny_llama_dir) -> str:
    return write_peft_adapter(tiny_llama_dir, str(tmp_path_factory.mktemp("patterned")), seed=1, r=8, alpha=12.0,
                              target_modules=("q_proj", "o_proj", "up_proj", "down_proj"),
                              rank_pattern={"up_proj": 2}, alpha_pattern={"o_proj": 3.0})


def raw_pairs(folder: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    out = {}
    for key, a in tensors.items():
        if ".lora_A." in key:
            parts = key.split(".")
            layer, proj = int(parts[parts.index("layers") + 1]), parts[parts.index("layers") + 3]
            out[(layer, proj)] = (a, tensors[key.replace("lora_A", "lora_B")])
    return out


def test_scales_follow_peft_rules(patterned, config, tiny_llama_dir):
    """B' / B equals the scaling PEFT itself applies to each module."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), patterned)
    scaling = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "scaling") and isinstance(module.scaling, dict) and "default" in module.scaling:
            parts = name.split(".")
            scaling[(int(parts[parts.index("layers") + 1]), parts[-1])] = module.scaling["default"]
    adapter = load_peft_adapter(patterned, config, max_lora_rank=16)
    raw = raw_pairs(patterned)
    assert set(adapter.modules) == set(raw) == set(scaling)
    assert {s for (_, proj), s in scaling.items() if proj == "up_proj"} == {6.0}      # 12 / 2
    assert {s for (_, proj), s in scaling.items() if proj == "o_proj"} == {3.0 / 8}   # 3 / 8
    for key, (a, b) in adapter.modules.items():
        torch.testing.assert_close(a, raw[key][0])
        torch.testing.assert_close(b, raw[key][1] * scaling[key])
    assert adapter.rank == 8


def test_rslora_scale(tmp_path, tiny_llama_dir, config):
    folder = write_peft_adapter(tiny_llama_dir, str(tmp_path / "rs"), seed=2, r=4, alpha=6.0, use_rslora=True)
    adapter, raw = load_peft_adapter(folder, config, 16), raw_pairs(folder)
    for key, (_, b) in adapter.modules.items():
        torch.testing.assert_close(b, raw[key][1] * (6.0 / math.sqrt(4)))


def test_a_bin_file_reads_as_safetensors(tmp_path, patterned, config):
    folder = tmp_path / "bin"
    shutil.copytree(patterned, folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    os.remove(folder / "adapter_model.safetensors")
    torch.save(tensors, folder / "adapter_model.bin")
    a, b = load_peft_adapter(str(folder), config, 16), load_peft_adapter(patterned, config, 16)
    assert all(torch.equal(a.modules[k][1], b.modules[k][1]) for k in b.modules)


def _edited(patterned: str, tmp_path, config_edit: dict | None = None, tensors_edit=None) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(patterned, folder)
    if config_edit is not None:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**cfg, **config_edit}))
    if tensors_edit is not None:
        tensors = load_file(folder / "adapter_model.safetensors")
        save_file(tensors_edit(tensors), folder / "adapter_model.safetensors")
    return str(folder)


@pytest.mark.parametrize("edit,match", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "lora_only"}, "trained biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "only LORA"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
])
def test_unsupported_settings_are_refused(tmp_path, patterned, config, edit, match):
    with pytest.raises(LoraAdapterError, match=match):
        load_peft_adapter(_edited(patterned, tmp_path, edit), config, 16)


def _rename(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


@pytest.mark.parametrize("tensors_edit,match", [
    (_rename("layers.1.", "layers.7."), "layer 7; the model has 2"),
    (_rename("mlp.up_proj", "mlp.experts"), "cannot adapt"),
    (lambda t: {k: v for k, v in t.items() if "layers.0.self_attn.q_proj.lora_B" not in k}, "lora_A only"),
    (lambda t: {k: (v[:, :-1].contiguous() if "lora_A" in k else v) for k, v in t.items()}, "another model"),
    (lambda t: {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}, "cannot adapt"),
    (lambda t: {}, "no LoRA weights"),
])
def test_weights_that_do_not_fit_are_refused(tmp_path, patterned, config, tensors_edit, match):
    with pytest.raises(LoraAdapterError, match=match):
        load_peft_adapter(_edited(patterned, tmp_path, tensors_edit=tensors_edit), config, 16)


def test_rank_limit_and_missing_files(tmp_path, patterned, config):
    with pytest.raises(LoraAdapterError, match="rank 8 .* above max_lora_rank 4"):
        load_peft_adapter(patterned, config, 4)
    with pytest.raises(LoraAdapterError, match="neither a PEFT adapter folder nor"):
        load_peft_adapter(str(tmp_path / "nowhere"), config, 16)
    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        load_peft_adapter(str(tmp_path), config, 16)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraAdapterError, match="cannot be read"):
        load_peft_adapter(str(tmp_path), config, 16)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(LoraAdapterError, match="neither adapter_model.safetensors"):
        load_peft_adapter(str(tmp_path), config, 16)


@pytest.mark.parametrize("args,match", [(("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"),
                                        (("a", True, "/x"), "lora_int_id"), (("a", 1, 5), "lora_path")])
def test_lora_request_checks(args, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(*args)
    assert LoRARequest("a", 2, "/x").adapter_id == 2
