"""LoRA adapters: a request's adapter (``LoRARequest``) and PEFT's adapter folders read
(``peft_adapter``). The model's side, the low-rank products added in the linear layers, is
``model_executor/layers/lora.py``; the engine's, which adapters are loaded, ``engine/lora_adapters.py``."""
