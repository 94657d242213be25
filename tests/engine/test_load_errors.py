"""Clear errors at load: each names the file or argument and the problem,
before any tensor data is read. No weights are loaded (seconds)."""
from __future__ import annotations

import os
import struct

import pytest
import torch

from specserve import LLM
from specserve.config import EngineConfig
from specserve.model_executor.loader import (
    InvalidModelFileError,
    check_gguf_file,
    default_model_path,
    load_model,
)

HEADER_BYTES = 4 << 20   # the default GGUF's header, metadata (vocabulary) and tensor table fit in this


def gguf_copy(tmp_path, name: str, keep: int | None = None, size: int | None = None, patch=None) -> str:
    """A copy of the default GGUF's first ``keep`` bytes, stretched (sparse, zeros) to ``size``."""
    src = default_model_path()
    full = os.path.getsize(src)
    keep = min(HEADER_BYTES if keep is None else keep, full)
    with open(src, "rb") as fh:
        head = bytearray(fh.read(keep))
    if patch is not None:
        patch(head)
    out = tmp_path / name
    with open(out, "wb") as fh:
        fh.write(head)
        fh.truncate(full if size is None else size)
    return str(out)


def test_the_default_gguf_passes_the_check():
    check_gguf_file(default_model_path())


def test_an_intact_table_with_stretched_data_passes(tmp_path):
    """The check reads the header and table only; a file of the right size is accepted."""
    check_gguf_file(gguf_copy(tmp_path, "same-size.gguf"))


@pytest.mark.parametrize("variant,match", [
    (dict(keep=0, size=0), "shorter than a GGUF header"),
    (dict(keep=1000, size=1000), "inside its header"),
    (dict(keep=300_000, size=300_000), "inside its header"),     # within the vocabulary (bytes 1,062-960,150)
    (dict(size=HEADER_BYTES), "truncated"),
    (dict(size="minus-one"), "truncated"),
    (dict(patch=lambda b: b.__setitem__(slice(0, 4), b"GGUX")), "GGUF magic"),
    (dict(patch=lambda b: b.__setitem__(slice(4, 8), struct.pack("<I", 99))), "version 99"),
    # the first metadata value's type field (after the 24-byte header and the first key)
    (dict(patch=lambda b: b.__setitem__(slice(32 + struct.unpack_from("<Q", b, 24)[0],
                                              36 + struct.unpack_from("<Q", b, 24)[0]), struct.pack("<I", 77))),
     "unknown metadata value type 77"),
    (dict(patch=lambda b: b.__setitem__(slice(16, 24), struct.pack("<Q", 2**40))), "inside its header"),
], ids=["empty", "cut-in-header", "cut-in-vocabulary", "cut-in-data", "one-byte-short", "bad-magic", "bad-version", "bad-value-type",
        "absurd-kv-count"])
def test_broken_gguf_files_get_one_clear_sentence_naming_the_file(tmp_path, variant, match):
    if variant.get("size") == "minus-one":
        variant = dict(size=os.path.getsize(default_model_path()) - 1)
    path = gguf_copy(tmp_path, "broken.gguf", **variant)
    with pytest.raises(InvalidModelFileError, match=match) as info:
        load_model(path, torch.float32)
    assert path in str(info.value)
    with pytest.raises(InvalidModelFileError, match=match):
        LLM(model=path, dtype="float32")


def test_a_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(InvalidModelFileError, match="no config.json") as info:
        load_model(str(tmp_path), torch.float32)
    assert str(tmp_path) in str(info.value) and "model.safetensors" in str(info.value)


@pytest.mark.parametrize("model", [123, 1.5, ["a"], b"path"])
def test_a_model_that_is_not_a_string_is_a_type_error(model):
    with pytest.raises(TypeError, match="model must be a path"):
        LLM(model=model)
    with pytest.raises(TypeError, match="model must be a path"):
        load_model(model, torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_says_so(device):
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(device=device)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(device="tpu"), ValueError, "unknown device"),
    (dict(device="mps"), ValueError, "'cpu' or 'cuda'"),
    (dict(device=0), TypeError, "device must be a string"),
    (dict(dtype=5), TypeError, "dtype must be a string"),
    (dict(kv_cache_memory=1.5), ValueError, "kv_cache_memory"),
    (dict(kv_cache_memory=True), ValueError, "kv_cache_memory"),
    (dict(max_model_len="256"), ValueError, "max_model_len"),
    (dict(seed=None), ValueError, "seed"),
    (dict(block_size=0), ValueError, "block_size"),
])
def test_wrong_engine_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)
