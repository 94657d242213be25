"""A PEFT LoRA adapter folder -> its low-rank matrices per (layer, projection), checked against the model.

PEFT (``peft.LoraModel.save_pretrained``) writes adapter_config.json and adapter_model.safetensors
(older versions adapter_model.bin), with tensors named like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]). A projection's output gains ``scale * B @ (A @ x)``, where ``scale`` is
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``); ``rank_pattern`` and
``alpha_pattern`` set r and alpha per module. The scale is folded into B here, so the model adds
``B' @ (A @ x)``.

What specserve cannot run is refused here, before any request uses it, by name: DoRA, trained
biases, ``modules_to_save`` (fully trained embeddings or heads), adapters on embeddings or the LM
head, layers the model does not have, ranks above ``max_lora_rank`` and shapes that do not fit.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# The decoder's projections a LoRA may adapt, by their Hugging Face names (Phi-3 ships qkv_proj and
# gate_up_proj fused).
ADAPTABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.*layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+))"
                  r"\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")

# adapter_config.json settings specserve does not run, with the value that is fine.
_UNSUPPORTED = {
    "use_dora": (False, "DoRA adapters (use_dora) are not supported"),
    "modules_to_save": (None, "adapters with modules_to_save (fully trained modules) are not supported"),
    "layer_replication": (None, "adapters with layer_replication are not supported"),
    "lora_bias": (False, "adapters with trained biases (lora_bias) are not supported"),
    "use_qalora": (False, "QALoRA adapters (use_qalora) are not supported"),
    "target_parameters": (None, "adapters on parameters (target_parameters) are not supported"),
}


class LoraAdapterError(ValueError):
    """An adapter folder specserve cannot run, and why (a ValueError: bad input)."""


@dataclass
class LoraAdapter:
    """One adapter's matrices: {(layer, projection): (A [r, in], B [out, r] with the scale folded in)}."""

    path: str
    rank: int                                   # the largest rank of any module
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def expected_shapes(config) -> dict[str, tuple[int, int]]:
    """{projection: (out features, in features)} of the decoder described by a Hugging Face ``config``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
            "qkv_proj": (q + 2 * kv, hidden), "gate_up_proj": (2 * inter, hidden)}


def check_pair(path: str, layer: int, proj: str, a: torch.Tensor, b: torch.Tensor, shapes: dict,
               max_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's (A [r, in], B [out, r]) as float32, checked against the model's shapes
    (``expected_shapes``) and the rank limit."""
    a, b = a.float().contiguous(), b.float()
    rank = a.shape[0]
    out, inp = shapes[proj]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or tuple(b.shape) != (out, rank):
        raise LoraAdapterError(f"LoRA adapter {path!r}: layer {layer} {proj} has A {tuple(a.shape)} and B "
                               f"{tuple(b.shape)}; this model needs A [r, {inp}] and B [{out}, r] "
                               f"(an adapter for another model?)")
    if rank > max_lora_rank:
        raise LoraAdapterError(f"LoRA adapter {path!r} has rank {rank} (layer {layer} {proj}), above "
                               f"max_lora_rank {max_lora_rank}")
    return a, b


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule for rank_pattern / alpha_pattern: the first key that matches the end of the module's name."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise LoraAdapterError(f"LoRA adapter {path!r} is neither a PEFT adapter folder nor a llama.cpp .gguf file")
    if not os.path.isfile(file):
        raise LoraAdapterError(f"LoRA adapter {path!r} has no adapter_config.json (is it a PEFT adapter folder?)")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoraAdapterError(f"LoRA adapter {path!r}: adapter_config.json cannot be read: {e}") from e
    if not isinstance(cfg, dict):
        raise LoraAdapterError(f"LoRA adapter {path!r}: adapter_config.json is not an object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraAdapterError(f"LoRA adapter {path!r} is a {cfg.get('peft_type')} adapter; only LORA is supported")
    for field, (fine, why) in _UNSUPPORTED.items():
        value = cfg.get(field, fine)
        if value not in (fine, None, False, [], {}):
            raise LoraAdapterError(f"LoRA adapter {path!r}: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoraAdapterError(f"LoRA adapter {path!r}: trained biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise LoraAdapterError(f"LoRA adapter {path!r}: fan_in_fan_out (GPT-2's Conv1D layers) is not supported")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise LoraAdapterError(f"LoRA adapter {path!r} has neither adapter_model.safetensors nor adapter_model.bin")


def load_peft_adapter(path: str, config, max_lora_rank: int) -> LoraAdapter:
    """Read and check the adapter folder ``path`` for the model of Hugging Face ``config``."""
    path = os.fspath(path)
    cfg = read_adapter_config(path)
    tensors = _read_tensors(path)
    shapes = expected_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m["proj"] not in ADAPTABLE:
            raise LoraAdapterError(f"LoRA adapter {path!r}: {key!r} adapts a module specserve cannot adapt "
                                   f"(the decoder layers' {', '.join(ADAPTABLE)} only)")
        layer = int(m["layer"])
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(f"LoRA adapter {path!r}: {key!r} is for layer {layer}; the model has "
                                   f"{config.num_hidden_layers}")
        pairs.setdefault((layer, m["proj"]), {})[m["ab"]] = tensor
        names[(layer, m["proj"])] = m["module"]
    if not pairs:
        raise LoraAdapterError(f"LoRA adapter {path!r} holds no LoRA weights")
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter {path!r}: layer {layer} {proj} has lora_{''.join(ab)} only")
        a, b = check_pair(path, layer, proj, ab["A"], ab["B"], shapes, max_lora_rank)
        module = names[(layer, proj)]
        r = _pattern_value(cfg.get("rank_pattern"), module, cfg.get("r", a.shape[0]))
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules[(layer, proj)] = (a, (b * scale).contiguous())
    return LoraAdapter(path, max(a.shape[0] for a, _ in modules.values()), modules)
