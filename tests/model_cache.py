"""One load per model for a test module: ``load_model`` patched to hand out the first load's
read-only tensors in a fresh dict (the loader itself is tested in tests/model_executor)."""
from __future__ import annotations

import contextlib
import dataclasses

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
