"""PEFT LoRA adapters the tests write for a model folder: random, so they change the model's output."""
from __future__ import annotations

import torch


def write_peft_adapter(model_dir: str, folder: str, seed: int, target_modules=("q_proj", "v_proj", "down_proj"),
                       r: int = 4, alpha: float = 16.0, **config) -> str:
    """A PEFT LoRA adapter for the Hugging Face model in ``model_dir``, A and B drawn at random (PEFT's
    ``init_lora_weights=False``, B scaled up so the adapter changes greedy choices), saved in
    ``folder`` with ``save_pretrained``. ``config``: more LoraConfig fields (use_rslora, rank_pattern, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules),
                                                 init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(folder)
    return folder


def peft_logits(model_dir: str, adapter_dir: str | None, token_ids: list[int]) -> torch.Tensor:
    """Transformers' (+ PEFT's) logits [T, V] over ``token_ids``: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
