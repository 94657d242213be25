"""A model's recommended sampling defaults (``model_executor/generation_config.py``): read from a
folder's generation_config.json by vLLM's rule, from a GGUF file's general.sampling.* metadata,
turned off with "vllm", overridden, and checked."""
from __future__ import annotations

import json

import pytest
from gguf import GGUFWriter

from specserve.model_executor.generation_config import GenerationConfigError, sampling_defaults
from specserve.sampling_params import SamplingParams


def folder_with(tmp_path, values) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return str(tmp_path)


def gguf_with(tmp_path, sampling: dict) -> str:
    path = str(tmp_path / "model.gguf")
    writer = GGUFWriter(path, "llama")
    for key, value in sampling.items():
        if isinstance(value, int):
            writer.add_int32(f"general.sampling.{key}", value)
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_folder_gives_the_sampling_fields_it_sets(tmp_path):
    folder = folder_with(tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                    "repetition_penalty": 1.05, "max_new_tokens": 64, "bos_token_id": 1,
                                    "min_p": None})
    assert sampling_defaults(folder) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                         "repetition_penalty": 1.05, "max_tokens": 64}


def test_do_sample_false_does_not_make_a_temperature_greedy(tmp_path):
    """As in vLLM, which does not read do_sample either."""
    folder = folder_with(tmp_path, {"do_sample": False, "temperature": 0.6})
    assert sampling_defaults(folder) == {"temperature": 0.6}


def test_no_file_under_auto_is_no_defaults_and_vllm_ignores_the_file(tmp_path):
    assert sampling_defaults(str(tmp_path)) == {}
    folder = folder_with(tmp_path, {"temperature": 0.2})
    assert sampling_defaults(folder, "vllm") == {}


def test_a_named_folder_or_file_replaces_the_models_own(tmp_path):
    model = folder_with(tmp_path, {"temperature": 0.2})
    other = tmp_path / "other"
    other.mkdir()
    folder_with(other, {"temperature": 0.9, "top_k": 0})
    expected = {"temperature": 0.9, "top_k": -1}       # top_k 0 (off) is specserve's -1
    assert sampling_defaults(model, str(other)) == expected
    assert sampling_defaults(model, str(other / "generation_config.json")) == expected
    with pytest.raises(GenerationConfigError, match="no folder holding generation_config.json"):
        sampling_defaults(model, str(tmp_path / "missing"))


def test_a_gguf_files_sampling_metadata(tmp_path):
    path = gguf_with(tmp_path, {"temp": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "penalty_repeat": 1.1,
                                "penalty_last_n": 64, "mirostat": 0})
    got = sampling_defaults(path)
    assert got.keys() == {"temperature", "top_k", "top_p", "min_p", "repetition_penalty"}
    assert got["top_k"] == 20 and got["temperature"] == pytest.approx(0.6) and got["min_p"] == pytest.approx(0.05)
    assert sampling_defaults(gguf_with(tmp_path, {}), "auto") == {}


def test_overrides_set_fields_on_top_by_the_files_names(tmp_path):
    folder = folder_with(tmp_path, {"temperature": 0.7, "top_p": 0.8})
    got = sampling_defaults(folder, overrides={"temperature": 0.0, "max_new_tokens": 9})
    assert got == {"temperature": 0.0, "top_p": 0.8, "max_tokens": 9}
    assert sampling_defaults(folder, "vllm", overrides={"top_k": 5}) == {"top_k": 5}
    with pytest.raises(GenerationConfigError, match="unknown field 'temp'"):
        sampling_defaults(folder, overrides={"temp": 0.5})


@pytest.mark.parametrize("values, field", [({"temperature": -1}, "temperature"), ({"top_p": 2.0}, "top_p"),
                                           ({"max_new_tokens": 0}, "max_tokens")])
def test_invalid_values_are_refused_naming_the_source(tmp_path, values, field):
    folder = folder_with(tmp_path, values)
    with pytest.raises(GenerationConfigError, match=f"generation config of .*{field}"):
        sampling_defaults(folder)


def test_an_unreadable_file_is_a_clear_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match="not a readable JSON file"):
        sampling_defaults(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(GenerationConfigError, match="JSON object"):
        sampling_defaults(str(tmp_path))


def test_the_result_builds_sampling_params(tmp_path):
    folder = folder_with(tmp_path, {"temperature": 0.7, "top_k": 20, "max_new_tokens": 64})
    params = SamplingParams(**sampling_defaults(folder))
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 20, 64)
