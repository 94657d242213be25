"""One load per model for a test module: ``load_model`` patched to hand out the first load's
read-only tensors in a fresh dict (the loader itself is tested in tests/model_executor).
And one tokenizer and config read per shared folder for the session (``share_folder``)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os

import pytest

from specserve.engine import llm_engine
from specserve.model_executor import loader
from specserve.spec_decode import factory


@contextlib.contextmanager
def cached_model_loads():
    """Patch the engine's and the draft factory's ``load_model``; yields the patched function,
    whose ``calls`` counts requests (to show that invalid configurations fail before loading)."""
    cache = {}
    real = loader.load_model

    def cached(model, dtype, load_weights=True, keep_quantized=False, int8_activations=False):
        cached.calls += 1
        key = (model or loader.default_model_path(), dtype, load_weights, keep_quantized, int8_activations)
        if key not in cache:
            cache[key] = real(model, dtype, load_weights, keep_quantized, int8_activations)
        hit = cache[key]
        return dataclasses.replace(hit, state_dict=dict(hit.state_dict))

    cached.calls = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "load_model", cached)
        mp.setattr(factory, "load_model", cached)
        yield cached


# Folders written once by a fixture and only read after (conftest's tiny models, ...). Reading
# their tokenizer takes ~0.3 s (the default model's 49152-token vocabulary, parsed as JSON) and
# the tests build a hundred-odd engines on them.
_SHARED_FOLDERS: set[str] = set()


def share_folder(folder: str) -> str:
    """Let every load of ``folder`` in this session share one tokenizer and config read."""
    _SHARED_FOLDERS.add(os.path.realpath(folder))
    return folder


def _fingerprint(folder: str) -> tuple:
    """The folder's files as they are now: a folder changed after its first read reads afresh."""
    with os.scandir(folder) as entries:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file()))


class _ReadOnce:
    """``AutoTokenizer``/``AutoConfig`` as the loader sees them: ``from_pretrained`` of a shared
    folder reads it once (the same tokenizer object, which nothing edits; a copy of the config,
    which the loader edits); any other call goes to transformers unchanged."""

    def __init__(self, auto, copy_result: bool):
        self._auto, self._copy, self._read = auto, copy_result, {}

    def from_pretrained(self, path, *args, **kwargs):
        if args or kwargs or not isinstance(path, (str, os.PathLike)) or os.path.realpath(path) not in _SHARED_FOLDERS:
            return self._auto.from_pretrained(path, *args, **kwargs)
        key = (os.path.realpath(path), _fingerprint(path))
        if key not in self._read:
            self._read[key] = self._auto.from_pretrained(path)
        return copy.deepcopy(self._read[key]) if self._copy else self._read[key]

    def __getattr__(self, name):
        return getattr(self._auto, name)


@contextlib.contextmanager
def shared_folder_loads():
    """Patch the loader's ``AutoTokenizer`` and ``AutoConfig`` for ``share_folder`` folders."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "AutoTokenizer", _ReadOnce(loader.AutoTokenizer, copy_result=False))
        mp.setattr(loader, "AutoConfig", _ReadOnce(loader.AutoConfig, copy_result=True))
        yield
