"""transformers' own loading of a GGUF file (``gguf_file=``, dequantized, float32): the independent
reference of the real-model tests, with the file's metadata parsed once.

transformers parses a GGUF file twice, for the config and again for the weights
(``load_gguf_checkpoint``), with gguf's ``GGUFReader``, which walks every vocabulary string in
Python: about 28 s a parse for Gemma 3's 262,144 tokens on a 2-core machine, 7 s for the default
model's 49,152. The reader only reads, so one parse serves both; what transformers builds from it
is unchanged.
"""
from __future__ import annotations

import contextlib
import os

import gguf
import pytest
import torch


@contextlib.contextmanager
def one_parse_per_file():
    """While open, ``gguf.GGUFReader(path)`` returns the reader it built for that path before."""
    real = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield


def causal_lm_from_gguf(path: str):
    """transformers' model of a GGUF file, in float32 and eval mode."""
    from transformers import AutoModelForCausalLM

    folder, filename = os.path.split(path)
    with one_parse_per_file():
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32).eval()
