"""llama.cpp's LoRA files (model_executor/gguf_lora.py): a PEFT adapter written as its converter
writes it (tests/gguf_writer.py: gguf-py's names, q/k rows of B permuted on Llama, alpha) reads back
as the PEFT folder's matrices, and runs to the same tokens; files that are not LoRA adapters, or
adapt what specserve cannot, are refused by name. With llama.cpp's own converter at hand (the peer
build's source), its output reads back the same too."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType

from specserve import LLM, LoRARequest, SamplingParams
from specserve.lora.peft_adapter import LoraAdapterError, load_peft_adapter
from specserve.model_executor.gguf_lora import load_gguf_adapter
from specserve.model_executor.loader import load_model

from gguf_writer import write_lora_gguf
from lora_adapters import write_peft_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
F16 = GGMLQuantizationType.F16
CONVERTER = os.path.expanduser("~/.cache/specserve-peers/llama.cpp/src/convert_lora_to_gguf.py")


def _same_modules(a, b, atol=0.0):
    assert set(a.modules) == set(b.modules)
    for key in b.modules:
        for x, y in zip(a.modules[key], b.modules[key]):
            torch.testing.assert_close(x, y, atol=atol, rtol=0)


def test_a_converted_adapter_reads_as_its_peft_folder_and_runs_the_same(peaked_llama_dir, tmp_path):
    folder = write_peft_adapter(peaked_llama_dir, str(tmp_path / "peft"), seed=1,
                                target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    config = load_model(peaked_llama_dir, torch.float32, load_weights=False).config
    path = write_lora_gguf(folder, config, tmp_path / "adapter.gguf")
    _same_modules(load_gguf_adapter(path, config, 16), load_peft_adapter(folder, config, 16))
    half = write_lora_gguf(folder, config, tmp_path / "adapter-f16.gguf", qtype=F16)     # --outtype f16
    _same_modules(load_gguf_adapter(half, config, 16), load_peft_adapter(folder, config, 16), atol=5e-3)
    llm = LLM(peaked_llama_dir, dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=12)
    from_file = llm.generate("Hello there", params, lora_request=LoRARequest("gguf", 1, path))
    from_folder = llm.generate("Hello there", params, lora_request=LoRARequest("peft", 2, folder))
    assert from_file[0].outputs[0].token_ids == from_folder[0].outputs[0].token_ids


def test_qwen2_b_rows_stay_as_they_are(tmp_path):
    """Qwen2's q/k are not permuted by llama.cpp: B's rows are read as stored."""
    from model_families import tiny_model

    hf = tiny_model("qwen2")
    model_dir = tmp_path / "qwen2"
    hf.save_pretrained(model_dir)
    folder = write_peft_adapter(str(model_dir), str(tmp_path / "peft"), seed=2, target_modules=("q_proj", "k_proj"))
    path = write_lora_gguf(folder, hf.config, tmp_path / "adapter.gguf")
    _same_modules(load_gguf_adapter(path, hf.config, 16), load_peft_adapter(folder, hf.config, 16))


def test_what_is_not_a_usable_adapter_is_refused(peaked_llama_dir, tmp_path):
    from gguf import GGUFWriter
    import numpy as np

    config = load_model(peaked_llama_dir, torch.float32, load_weights=False).config
    with pytest.raises(LoraAdapterError, match="not a LoRA adapter file"):
        load_gguf_adapter(load_model(None, torch.float32, load_weights=False).source, config, 16)

    def adapter_file(name: str, tensors: dict) -> str:
        writer = GGUFWriter(str(tmp_path / name), "llama")
        writer.add_type("adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", 8.0)
        for tensor_name, data in tensors.items():
            writer.add_tensor(tensor_name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return str(tmp_path / name)

    a = np.zeros((4, 64), dtype=np.float32)
    with pytest.raises(LoraAdapterError, match="cannot adapt"):
        load_gguf_adapter(adapter_file("embd.gguf", {"token_embd.weight.lora_a": a}), config, 16)
    with pytest.raises(LoraAdapterError, match="lora_a only"):
        load_gguf_adapter(adapter_file("half.gguf", {"blk.0.attn_q.weight.lora_a": a}), config, 16)
    with pytest.raises(LoraAdapterError, match="layer 9"):
        load_gguf_adapter(adapter_file("deep.gguf", {"blk.9.attn_q.weight.lora_a": a}), config, 16)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(CONVERTER), reason="llama.cpp's source (bash ../shared/peers/build-llamacpp.sh)")
def test_llama_cpps_own_converter_output_reads_as_the_peft_folder(peaked_llama_dir, tmp_path):
    folder = write_peft_adapter(peaked_llama_dir, str(tmp_path / "peft"), seed=3,
                                target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"))
    out = tmp_path / "converted.gguf"
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(CONVERTER), "gguf-py")}
    subprocess.run([sys.executable, CONVERTER, "--base", peaked_llama_dir, "--outtype", "f32", "--outfile", str(out),
                    folder], check=True, capture_output=True, env=env, timeout=300)
    config = load_model(peaked_llama_dir, torch.float32, load_weights=False).config
    _same_modules(load_gguf_adapter(str(out), config, 16), load_peft_adapter(folder, config, 16))
