"""The sampling defaults a model's makers recommend (vLLM's ``generation_config``).

A Hugging Face folder may hold ``generation_config.json`` (Qwen2.5's instruct models: temperature
0.7, top_p 0.8, top_k 20, repetition_penalty 1.05, 1.1 for the small ones); a GGUF file may hold the same advice as
``general.sampling.*`` metadata, which llama.cpp's converter writes from that file and llama.cpp
takes as its defaults. As in vLLM, these become the defaults of every request that does not set
the field itself: the server's requests, ``LLM.generate`` without sampling params
(``LLM.get_default_sampling_params()``) and ``specserve generate`` without the flag.

``generation_config`` (EngineConfig; ``--generation-config``):

- ``"auto"`` (default): the model's own file or metadata, if it has any;
- ``"vllm"``: none, specserve's defaults (``SamplingParams``'s) for every field;
- a folder holding a ``generation_config.json``, or the file itself: that file's values.

``override_generation_config`` (``--override-generation-config '{"temperature": 0.5}'``) sets
fields on top, by the same names.

Which fields, as vLLM reads them: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, and ``max_new_tokens`` as ``max_tokens`` (the server caps each request's
max_tokens at it), each where the file sets it (transformers writes only the values that differ
from its defaults, and with transformers 5 every default is unset). ``do_sample`` is not read
(vLLM does not either): a file with ``do_sample: false`` and ``temperature: 0.6`` samples at
0.6. From GGUF metadata: ``temp``, ``top_p``, ``top_k``, ``min_p`` and ``penalty_repeat``
(llama.cpp applies it to the last ``penalty_last_n`` tokens, specserve's repetition_penalty to
every prompt and output token, as vLLM's does). A top_k of 0 (off, in both formats) becomes -1.
"""
from __future__ import annotations

import json
import os

from specserve.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_CHOICES = ("auto", "vllm")   # besides a folder or a file

# generation_config.json name -> SamplingParams field
_FILE_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata key (llama.cpp's) -> SamplingParams field
_GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                "general.sampling.penalty_repeat": "repetition_penalty"}


class GenerationConfigError(ValueError):
    """A generation config that cannot be read or whose values are not valid sampling params."""


def sampling_defaults(model_path: str, generation_config: str = "auto",
                      overrides: dict | None = None) -> dict:
    """{SamplingParams field: value} for the model at ``model_path`` (a GGUF file or a folder);
    checked: ``SamplingParams(**result)`` is valid, else GenerationConfigError naming the source."""
    if generation_config == "vllm":
        defaults, source = {}, None
    elif generation_config == "auto":
        source = model_path
        defaults = _from_gguf(model_path) if os.path.isfile(model_path) else _from_folder(model_path, required=False)
    else:
        source = os.path.abspath(os.path.expanduser(generation_config))
        defaults = _from_folder(source, required=True)
    for name, value in (overrides or {}).items():
        if name not in _FILE_FIELDS:
            raise GenerationConfigError(f"override_generation_config: unknown field {name!r}; "
                                        f"known fields: {sorted(_FILE_FIELDS)}")
        defaults[_FILE_FIELDS[name]] = value
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        where = f"the generation config of {source}" if source else "override_generation_config"
        raise GenerationConfigError(f"{where} gives sampling defaults that are not valid: {e}") from None
    return defaults


def _from_folder(path: str, required: bool) -> dict:
    """A folder's generation_config.json (or the file named), by vLLM's rule (module docstring)."""
    file = path if os.path.isfile(path) else os.path.join(path, GENERATION_CONFIG_FILE)
    if not os.path.isfile(file):
        if required:
            raise GenerationConfigError(f"generation_config {path!r}: no such file, and no folder holding "
                                        f"{GENERATION_CONFIG_FILE}")
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"{file}: not a readable JSON file: {e}") from None
    if not isinstance(values, dict):
        raise GenerationConfigError(f"{file}: a generation config is a JSON object, got {type(values).__name__}")
    return {field: values[name] for name, field in _FILE_FIELDS.items() if values.get(name) is not None}


def _from_gguf(path: str) -> dict:
    from specserve.model_executor.gguf_file import read_gguf_table

    metadata = read_gguf_table(path).metadata
    return {field: metadata[key] for key, field in _GGUF_FIELDS.items() if key in metadata}
