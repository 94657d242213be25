"""A llama.cpp LoRA adapter file (GGUF, ``general.type`` "adapter") -> its matrices per (layer, projection).

llama.cpp's ``convert_lora_to_gguf.py`` writes a PEFT adapter as ``blk.N.<tensor>.weight.lora_a``
([r, in]) and ``.lora_b`` ([out, r]) with ``adapter.lora.alpha``; llama.cpp adds
``alpha / r * B (A x)`` (``--lora``, scale 1). The rows of q's and k's B are in llama.cpp's rotary
order for the families whose weights it permutes, so they are put back as the model's weights are
(``loader``). The adapter is then what ``lora.peft_adapter`` gives for a PEFT folder, checked the
same way.
"""
from __future__ import annotations

import numpy as np
import torch

from specserve.lora.peft_adapter import ADAPTABLE, LoraAdapter, LoraAdapterError, check_pair, expected_shapes
from specserve.model_executor.gguf_file import read_gguf_table
from specserve.model_executor.loader import _GGUF_PERMUTED_ARCHS, _gguf_to_hf_name, _unpermute_rope_rows


def _tensor(path: str, t) -> torch.Tensor:
    """A tensor's values, float32, in torch order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.fromfile(path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
    qtype = GGMLQuantizationType(t.ggml_type)
    if qtype == GGMLQuantizationType.F32:
        values = raw.view(np.float32)
    elif qtype == GGMLQuantizationType.F16:
        values = raw.view(np.float16)
    else:
        values = dequantize(raw.reshape(t.shape[0], -1), qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(t.shape))


def load_gguf_adapter(path: str, config, max_lora_rank: int) -> LoraAdapter:
    """Read and check llama.cpp's LoRA file ``path`` for the model of Hugging Face ``config``."""
    try:
        table = read_gguf_table(path)
    except ValueError as e:
        raise LoraAdapterError(f"LoRA adapter {path!r}: {e}") from None
    meta = table.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoraAdapterError(f"{path!r} is not a LoRA adapter file (general.type {meta.get('general.type')!r}, "
                               f"adapter.type {meta.get('adapter.type')!r}): llama.cpp's convert_lora_to_gguf.py "
                               f"writes one")
    alpha = float(meta.get("adapter.lora.alpha", 0.0) or 0.0)
    shapes = expected_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in table.tensors:
        base, _, which = t.name.rpartition(".")
        try:
            hf = _gguf_to_hf_name(base, table.architecture) if which in ("lora_a", "lora_b") else None
        except ValueError:
            hf = None
        parts = (hf or "").split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if not hf or not hf.startswith("model.layers.") or proj not in ADAPTABLE:
            raise LoraAdapterError(f"LoRA adapter {path!r}: {t.name!r} adapts a module specserve cannot adapt "
                                   f"(the decoder layers' projections only)")
        layer = int(parts[2])
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(f"LoRA adapter {path!r}: {t.name!r} is for layer {layer}; the model has "
                                   f"{config.num_hidden_layers}")
        value = _tensor(path, t)
        if which == "lora_b" and table.architecture in _GGUF_PERMUTED_ARCHS and proj in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if proj == "q_proj" else config.num_key_value_heads
            value = _unpermute_rope_rows(value, heads)
        pairs.setdefault((layer, proj), {})[which] = value
    if not pairs:
        raise LoraAdapterError(f"LoRA adapter {path!r} holds no LoRA weights")
    modules = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"lora_a", "lora_b"}:
            raise LoraAdapterError(f"LoRA adapter {path!r}: layer {layer} {proj} has {''.join(ab)} only")
        a, b = check_pair(path, layer, proj, ab["lora_a"], ab["lora_b"], shapes, max_lora_rank)
        scale = alpha / a.shape[0] if alpha else 1.0          # llama.cpp's rule (no alpha: the scale alone)
        modules[(layer, proj)] = (a, (b * scale).contiguous())
    return LoraAdapter(path, max(a.shape[0] for a, _ in modules.values()), modules)
