"""GGUF files of every family, written as llama.cpp's converter writes them (tests/gguf_writer.py),
load with the configuration of the Hugging Face model they came from and give its logits.

Each case is a tiny random model of tests/model_families.py with the default model's vocabulary
(so the file carries the default model's tokenizer metadata), written as F32 and as Q8_0. A
prompt of 40 tokens runs past the 16-token sliding windows and past the rope scalings' original
context (32; Phi-3's longrope is compared within its original context, 128, where transformers
and a per-position table agree, see layers/rotary.py). Tolerances, float32 throughout:

- F32 file against transformers on the model: max abs logit difference < 1e-4 (measured ~6e-6,
  logits of magnitude ~6);
- Q8_0 file, dequantized at load or kept as blocks (QuantizedMatrix through the CPU kernel),
  against transformers on the model whose matrices went through the same Q8_0 round trip:
  < 1e-4 (measured ~6e-6 and ~2e-5); the Q8_0 round trip itself moves the logits by ~0.3.

The configs transformers' own GGUF conversion builds for the same files give other logits
(llama3, linear, yarn, Gemma 2/3, Phi-3, a windowed mistral file: by 5 to 8), fail to load
(Qwen3) or do not exist (granite, olmo2, smollm3): ``test_transformers_config_*`` and
``test_families_transformers_has_no_gguf_config_for``, which also name the fields corrected.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict

import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoConfig

from specserve.model_executor import gguf_config, loader
from specserve.model_executor.gguf_config import config_from_gguf
from specserve.model_executor.layers.rotary import RotaryEmbedding
from specserve.model_executor.loader import (InvalidModelFileError, UnsupportedArchitectureError,
                                             default_model_path, load_model)
from specserve.model_executor.models.decoder_spec import spec_for

from gguf_writer import Q8_0, dequantized_copy, write_gguf
from model_families import WINDOW, tiny_model
from test_decoder import hf_logits, make_runner, prompt, run_chunks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4
PROMPT_LEN = 40
DEFAULT_VOCAB = 49152   # the default model's tokenizer, whose metadata the files carry

# case -> (family of tests/model_families.py, config overrides, GGUF architecture if not the family's).
# The overrides make a model the GGUF format can express: llama.cpp fixes what the file has no key for.
CASES = {
    "llama": ("llama", {}, None),
    "llama3": ("llama3", {}, None),               # rope_freqs tensor
    "llama_linear": ("llama_linear", {}, None),
    "qwen2": ("qwen2", {}, None),
    "qwen2_yarn": ("qwen2_yarn", {}, None),
    "qwen3": ("qwen3", {}, None),                 # head_dim 24 != hidden / heads
    # llama.cpp converts Mistral as "llama", without its window (Mistral 7B v0.2+ has none) ...
    "mistral": ("mistral", {"sliding_window": None}, None),
    # ... other writers' "mistral" files keep it
    "mistral_arch": ("mistral", {}, "mistral"),
    # Gemma's attention scale is head_dim (hidden / heads for the 27B models) in llama.cpp
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}, None),
    # llama.cpp: five sliding layers, then a global one (with its own rope base and scaling)
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16, "num_hidden_layers": 6,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, None),
    "phi3": ("phi3", {}, None),                   # longrope factors, partial rotary, window 24
    "granite": ("granite", {}, None),
    "olmo2": ("olmo2", {}, None),
    # llama.cpp: every fourth layer without rotary
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]}, None),
}


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory):
    """Converted configs and tokenizers go to a cache folder of this module's own (under the same
    keys); the compiled kernels' cache, also under $SPECSERVE_CACHE_DIR, stays where it is."""
    root, real = tmp_path_factory.mktemp("gguf-cache"), loader._cache_dir
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "_cache_dir", lambda path: str(root / os.path.basename(real(path))))
        yield


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, F32 file with the default model's tokenizer, Q8_0 file with a placeholder one)."""
    family, overrides, arch = CASES[request.param]
    hf = tiny_model(family, vocab_size=DEFAULT_VOCAB, **overrides)
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    f32 = write_gguf(hf, folder / "model-F32.gguf", default_model_path(), arch=arch)
    q8 = write_gguf(hf, folder / "model-Q8_0.gguf", None, qtype=Q8_0, arch=arch)   # read without its tokenizer
    return request.param, hf, f32, q8


def run(loaded, tokens) -> torch.Tensor:
    return run_chunks(make_runner(loaded.config, loaded.state_dict), tokens, [len(tokens)], block_table=[7, 2, 19])


def _spec_fields(config) -> dict:
    """spec_for(config) as a dict, without the family name (a Mistral written by llama.cpp is a llama)."""
    fields = asdict(spec_for(config))
    fields.pop("family")
    return fields


def _same(a, b) -> bool:
    """Equal, floats to float32 precision (the file stores them as float32)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------------- configs
def test_config_computes_what_the_models_config_does(case):
    """Same decoder spec (norms, scales, soft-caps, each layer's window and rotary table) and the
    same rotary tables as the Hugging Face config; and the same config again from the cache."""
    name, hf, f32, _ = case
    loaded = load_model(f32, torch.float32, load_weights=False)
    expected_type = "llama" if name == "mistral" else hf.config.model_type
    assert loaded.config.model_type == expected_type
    assert _same(_spec_fields(loaded.config), _spec_fields(hf.config))
    spec = spec_for(loaded.config)
    for key in spec.rope_layer_types:
        ours = RotaryEmbedding.from_config(loaded.config, 64, key or None)
        ref = RotaryEmbedding.from_config(hf.config, 64, key or None)
        assert ours.rotary_dim == ref.rotary_dim
        assert (ours.cos - ref.cos).abs().max() < 1e-5 and (ours.sin - ref.sin).abs().max() < 1e-5
    cached = AutoConfig.from_pretrained(loader._cache_dir(f32))   # what the next load reads
    cached._name_or_path = f32
    assert cached.to_dict() == loaded.config.to_dict()


# Config fields where transformers' GGUF conversion of a case's file differs (the llama.cpp key read
# for each in the comment; gguf_config's module docstring lists them all).
CORRECTED = {
    "llama": set(),
    "llama3": {"rope_parameters"},                                   # rope_freqs tensor
    "llama_linear": {"rope_parameters"},                             # rope.scaling.type/factor
    "qwen2": {"attention_bias", "head_dim"},                         # added, values the model implies
    "qwen2_yarn": {"attention_bias", "head_dim", "rope_parameters"},  # + rope.scaling.* (yarn)
    "qwen3": {"head_dim"},                                           # attention.key_length
    "mistral": set(),
    "mistral_arch": {"sliding_window"},                              # attention.sliding_window
    "gemma2": {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"},
    "gemma3": {"query_pre_attn_scalar", "rope_parameters"},          # global layers' rope.scaling.*
    "phi3": {"head_dim", "original_max_position_embeddings", "rope_parameters", "sliding_window"},
}


@pytest.mark.parametrize("name", list(CORRECTED))
def test_transformers_config_differs_only_where_corrected(name, tmp_path):
    """Every field transformers' GGUF conversion sets, specserve sets the same, but for the
    corrections (module docstring of gguf_config). Files with a placeholder vocabulary of the
    tiny models' size: transformers parses every token with GGUFReader."""
    family, overrides, arch = CASES[name]
    path = write_gguf(tiny_model(family, **overrides), tmp_path / "model.gguf", None, arch=arch)
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file="model.gguf").to_dict()
    ours = config_from_gguf(path).to_dict()
    naming = {"_name_or_path", "_model_name_or_path", "architectures"}   # transformers sets no architectures
    differing = {k for k in (set(theirs) | set(ours)) - naming if theirs.get(k, "absent") != ours.get(k, "absent")}
    assert differing == CORRECTED[name]


@pytest.mark.parametrize("name", [n for n, fields in CORRECTED.items() if fields - {"attention_bias", "head_dim"}]
                         + ["qwen3"])
def test_transformers_config_computes_another_model(name, tmp_path):
    """The corrections matter: the same file's weights under transformers' GGUF config give other
    logits past the window and the original context (by 5 to 8 here), or do not load (Qwen3's
    head_dim)."""
    family, overrides, arch = CASES[name]
    hf = tiny_model(family, **overrides)
    path = write_gguf(hf, tmp_path / "model.gguf", None, arch=arch)
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    loader._check_architecture(theirs)   # as the loader did with it
    tokens = prompt(hf.config.vocab_size, PROMPT_LEN, seed=3)

    def logits():
        state_dict = loader._gguf_state_dict(path, theirs, torch.float32)
        return run_chunks(make_runner(theirs, state_dict), tokens, [len(tokens)], block_table=[7, 2, 19])

    if name == "qwen3":   # head_dim 128 (Qwen3Config's default) where the weights have 24
        with pytest.raises(RuntimeError, match="split"):
            logits()
        return
    assert (logits() - hf_logits(hf, tokens)).abs().max() > 1.0


@pytest.mark.parametrize("family", ["granite", "olmo2", "smollm3"])
def test_families_transformers_has_no_gguf_config_for(family, tmp_path):
    path = write_gguf(tiny_model(family), tmp_path / "model.gguf", None)
    with pytest.raises(ValueError, match="not supported"):
        AutoConfig.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    assert config_from_gguf(path).model_type == family


def test_windowed_mistral_converted_by_llama_cpp_runs_without_its_window(tmp_path):
    """llama.cpp writes MistralForCausalLM as a "llama" file with no window key and runs it with
    full attention; the file loads as that (no window invented)."""
    hf = tiny_model("mistral")
    assert hf.config.sliding_window == WINDOW
    config = config_from_gguf(write_gguf(hf, tmp_path / "model.gguf", None))
    assert config.model_type == "llama"
    assert all(layer.sliding_window is None for layer in spec_for(config).layers)


def test_gemma_27b_attention_scale_is_hidden_over_heads(tmp_path):
    """llama.cpp's rule for the file's missing query_pre_attn_scalar: hidden / heads for Gemma 2 27B
    (46 layers) and Gemma 3 27B (62 layers), head_dim otherwise."""
    for family, layers in (("gemma2", 46), ("gemma3", 62)):
        hf = tiny_model(family, num_hidden_layers=layers, head_dim=32, layer_types=None, vocab_size=64,
                        hidden_size=32, intermediate_size=32)
        config = config_from_gguf(write_gguf(hf, tmp_path / f"{family}.gguf", None))
        assert config.query_pre_attn_scalar == 32 // 4
        assert spec_for(config).attn_scale == pytest.approx((32 // 4) ** -0.5)


# ----------------------------------------------------------------------------------- logits
def test_f32_file_matches_transformers(case):
    name, hf, f32, _ = case
    tokens = prompt(DEFAULT_VOCAB, PROMPT_LEN, seed=3)
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 1.0, "random weights too small to make this test meaningful"
    assert (run(load_model(f32, torch.float32), tokens) - ref).abs().max() < ATOL


@pytest.fixture(scope="module")
def q8_reference(case) -> torch.Tensor:
    """transformers' logits on the case's model after the same Q8_0 round trip (shared by both loads)."""
    _, hf, _, _ = case
    tokens = prompt(DEFAULT_VOCAB, PROMPT_LEN, seed=3)
    ref = hf_logits(dequantized_copy(hf, Q8_0), tokens)
    assert (ref - hf_logits(hf, tokens)).abs().max() > 100 * ATOL   # the rounding does show
    return ref


@pytest.mark.parametrize("keep_quantized", [False, True], ids=["dequantized", "blocks"])
def test_q8_0_file_matches_transformers_on_the_same_rounding(case, q8_reference, keep_quantized):
    from specserve.model_executor.layers import quant_gemm
    from specserve.model_executor.layers.quantized import QuantizedMatrix

    if keep_quantized and not quant_gemm.available():
        pytest.skip("the quantized matmul kernel did not build")
    name, hf, _, q8 = case
    tokens = prompt(DEFAULT_VOCAB, PROMPT_LEN, seed=3)
    # the loader's two steps without the tokenizer (the F32 test loads through load_model)
    config = config_from_gguf(q8)
    state_dict = loader._gguf_state_dict(q8, config, torch.float32, keep_quantized=keep_quantized)
    assert isinstance(state_dict["model.layers.0.mlp.down_proj.weight"], QuantizedMatrix) == keep_quantized
    ours = run_chunks(make_runner(config, state_dict), tokens, [len(tokens)], block_table=[7, 2, 19])
    assert (ours - q8_reference).abs().max() < ATOL


# -------------------------------------------------------------------------------- tokenizers
@pytest.mark.parametrize("name", ["qwen2", "gemma3", "phi3", "granite", "olmo2", "smollm3"])
def test_tokenizer_from_the_file(name, tmp_path, default_model_tokenizer):
    """The tokenizer metadata gives the default model's tokenizer whatever the architecture
    (transformers builds it from tokenizer.ggml.model), in AutoTokenizer's class for the family."""
    family, overrides, arch = CASES[name]
    path = write_gguf(tiny_model(family, vocab_size=DEFAULT_VOCAB, **overrides), tmp_path / "model.gguf",
                      default_model_path(), arch=arch)
    tok = load_model(path, torch.float32, load_weights=False).tokenizer
    text = "Hello world,   a test <|im_start|>user\nhi 12345 ünïcödé\n\n  x<|im_end|>"
    assert tok.encode(text) == default_model_tokenizer.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.chat_template == default_model_tokenizer.chat_template
    assert tok.eos_token == default_model_tokenizer.eos_token


def test_default_model_tokenizer_equals_autotokenizers(default_model_tokenizer):
    """tokenizer_from_gguf picks AutoTokenizer's class without AutoTokenizer's config parse."""
    from transformers import AutoTokenizer

    folder, filename = os.path.split(default_model_path())
    auto = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    ours = gguf_config.tokenizer_from_gguf(default_model_path(), "llama")
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and ours.added_tokens_decoder == auto.added_tokens_decoder
    assert ours.chat_template == auto.chat_template
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (auto.bos_token, auto.eos_token, auto.pad_token)
    text = "The capital of France is <|im_end|>\n  Paris, 1234 ünï"
    assert ours.encode(text) == auto.encode(text) == default_model_tokenizer.encode(text)


# ---------------------------------------------------------------------------------- refusals
def _gguf_with(path, arch: str, keys: dict, tensors: dict | None = None) -> str:
    """A GGUF file with just these metadata keys (under ``arch.``) and tensors."""
    import numpy as np

    writer = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, data in (tensors or {"token_embd.weight": np.zeros((8, 4), np.float32)}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


_SHAPE = dict(context_length=64, block_count=2, feed_forward_length=8, embedding_length=4,
              **{"attention.head_count": 1, "attention.layer_norm_rms_epsilon": 1e-5})


@pytest.mark.parametrize("arch,keys,tensors,expected", [
    # llama.cpp's defaults where the converter wrote nothing
    ("llama", {}, None, dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("gemma2", {}, None, dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096)),
    # no attention.scale: llama.cpp scales by head_dim ** -0.5 (head_dim 4 here)
    ("granite", {}, None, dict(attention_multiplier=0.5, embedding_multiplier=1.0, residual_multiplier=1.0,
                               logits_scaling=1.0)),
    # keys the tiny models' converters do not write
    ("gemma3", {"attention.sliding_window": 0, "final_logit_softcapping": 30.0}, None,
     dict(sliding_window=None, layer_types=["full_attention"] * 2, final_logit_softcapping=30.0)),
    ("qwen2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16,
               "rope.scaling.yarn_attn_factor": 1.25, "rope.scaling.yarn_beta_fast": 16.0,
               "rope.scaling.yarn_beta_slow": 2.0}, None,
     dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 16, "attention_factor": 1.25, "beta_fast": 16.0,
                           "beta_slow": 2.0})),
    ("olmo2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16,
               "rope.scaling.attn_factor": 1.25}, None,
     dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 16, "attention_factor": 1.25})),
    ("phi3", {"rope.dimension_count": 2}, None,
     dict(original_max_position_embeddings=64, sliding_window=None,   # the context length
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    ("llama", {}, {"blk.0.attn_q.bias": [0.0] * 4, "blk.0.ffn_up.bias": [0.0] * 8},
     dict(attention_bias=True, mlp_bias=True)),
], ids=["llama-defaults", "gemma2-defaults", "granite-defaults", "gemma3-windowless-capped", "qwen2-yarn-params",
        "olmo2-yarn-attn-factor", "phi3-partial-rotary", "llama-biases"])
def test_keys_absent_or_uncommon(tmp_path, arch, keys, tensors, expected):
    import numpy as np

    extra = {"attention.key_length": 4} if arch.startswith("gemma") else {}
    arrays = {"token_embd.weight": np.zeros((8, 4), np.float32),
              **{k: np.asarray(v, np.float32) for k, v in (tensors or {}).items()}}
    config = config_from_gguf(_gguf_with(tmp_path / "model.gguf", arch, {**_SHAPE, **extra, **keys}, arrays))
    assert _same({k: getattr(config, k) for k in expected}, expected)
    if arch == "llama" and tensors:
        with pytest.raises(UnsupportedArchitectureError, match="mlp_bias"):
            spec_for(config)


def test_an_architecture_specserve_does_not_run_is_named(tmp_path):
    path = _gguf_with(tmp_path / "falcon.gguf", "falcon", _SHAPE)
    with pytest.raises(UnsupportedArchitectureError, match="GGUF architecture 'falcon'") as info:
        load_model(path, torch.float32)
    message = str(info.value)
    assert path in message and "Hugging Face folders" in message and "Gemma3ForCausalLM" in message


@pytest.mark.parametrize("arch,keys,tensors,match", [
    ("olmo2", {"attention.sliding_window": 4, "attention.sliding_window_pattern": [True, False]}, None, "OLMo 3"),
    ("llama", {"rope.scaling.type": "dynamic"}, None, "rope scaling type 'dynamic'"),
    ("llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
     {"rope_freqs.weight": [1.0, 2.0]}, "rope_freqs together with linear"),
], ids=["olmo3", "dynamic-rope", "rope-freqs-and-linear"])
def test_what_the_config_cannot_hold_is_refused(tmp_path, arch, keys, tensors, match):
    import numpy as np

    fields = {k: v for k, v in {**_SHAPE, **keys}.items() if v is not None}
    arrays = {"token_embd.weight": np.zeros((8, 4), np.float32),
              **{k: np.asarray(v, np.float32) for k, v in (tensors or {}).items()}}
    with pytest.raises(UnsupportedArchitectureError, match=match):
        config_from_gguf(_gguf_with(tmp_path / "model.gguf", arch, fields, arrays))


def test_a_file_without_a_key_the_converter_always_writes(tmp_path):
    shape = {k: v for k, v in _SHAPE.items() if k != "block_count"}
    path = _gguf_with(tmp_path / "model.gguf", "qwen2", shape)
    with pytest.raises(InvalidModelFileError, match="has no 'qwen2.block_count'") as info:
        load_model(path, torch.float32)
    assert path in str(info.value)


def test_caches_of_an_earlier_conversion_are_not_read(tmp_path, monkeypatch):
    """The converted-config cache is keyed on the conversion's version: a cache written before a
    correction (say, with Llama 3's rope_freqs dropped) is not read back."""
    path = default_model_path()
    before = loader._cache_dir(path)
    monkeypatch.setattr(loader, "_GGUF_CONVERSION_VERSION", loader._GGUF_CONVERSION_VERSION + 1)
    assert loader._cache_dir(path) != before
