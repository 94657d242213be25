"""The beam-search suite end to end on a tiny random model: one row per configuration, every
speculative search's beams identical to plain's, bad configurations refused."""
from __future__ import annotations

import argparse
import os

import pytest

from specserve.bench.options import spec_bench_path
from specserve.bench.suites import beam_search

# Spec-Bench's questions are the team's shared copy beside the checkout (bench/options.py).
needs_spec_bench = pytest.mark.skipif(not os.path.exists(spec_bench_path()),
                                      reason=f"no Spec-Bench questions at {spec_bench_path()}")


def args(model: str, configs: str, ngram_configs: str = "", spec_bench: str = "coding",
         extra: tuple[str, ...] = ()) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    beam_search.add_arguments(p)
    return p.parse_args(["--target", model, "--draft", model, "--configs", configs, "--ngram-model", model,
                         "--ngram-configs", ngram_configs, "--beam-width", "2", "--max-tokens", "6", "--limit", "1",
                         "--spec-bench", spec_bench, "--per-category", "1", "--max-model-len", "1024", *extra])


@needs_spec_bench
@pytest.mark.usefixtures("one_torch_thread")
def test_rows_per_configuration_and_identical_beams(tiny_llama_dir):
    doc = {}
    beam_search.run(args(tiny_llama_dir, "plain,draft:2", "plain,ngram:2"), doc)
    rows = doc["table"]["rows"]
    assert [r[1] for r in rows] == ["plain", "draft:2", "plain", "ngram:2"]
    assert all(r[-1] == "2/2" for r in rows)          # two prompts, the same beams as plain
    assert rows[0][2].startswith("1.00x (1.00)")      # plain against itself: tau 1


@pytest.mark.usefixtures("one_torch_thread")
def test_the_target_run_may_be_left_out(tiny_llama_dir):
    doc = {}
    beam_search.run(args(tiny_llama_dir, "", "plain,ngram:2", spec_bench=""), doc)
    assert [r[1] for r in doc["table"]["rows"]] == ["plain", "ngram:2"]
    assert list(doc["samples"]) == [f"n-gram run: {tiny_llama_dir}"]


def test_configurations_must_start_with_plain(tiny_llama_dir):
    # the project's own coding prompts only: this runs where the shared Spec-Bench copy is absent too
    with pytest.raises(ValueError, match="start with plain"):
        beam_search.run(args(tiny_llama_dir, "draft:2", spec_bench=""), {})
    with pytest.raises(ValueError, match="unknown configuration"):
        beam_search.run(args(tiny_llama_dir, "plain,nope:3", spec_bench=""), {})


@pytest.mark.parametrize("config", ["ngram:4:dynamic", "draft", "draft:2:3", "draft-tree:2", "ngram:x", "plain:1",
                                    "eagle:3:dynamic", "eagle-tree:2"])
def test_misspelled_configurations_are_refused_before_any_model_loads(tiny_llama_dir, config):
    """:dynamic on a kind that has no dynamic_k here, missing or extra fields: refused by name, whichever
    model's list holds them (the n-gram list's too, before the target's configurations run)."""
    with pytest.raises(ValueError, match="unknown configuration"):
        beam_search.run(args(tiny_llama_dir, "plain,draft:2", "plain," + config, spec_bench=""), {})


def test_speculative_configs_of_each_kind():
    assert beam_search.speculative_config("plain", "d") is None
    assert beam_search.speculative_config("draft:3:dynamic", "d") == {"model": "d", "num_speculative_tokens": 3,
                                                                      "dynamic_k": True}
    assert beam_search.speculative_config("draft-tree:2:8", "d")["tree"] == {"top_k": 2, "max_nodes": 8}
    assert beam_search.speculative_config("eagle:3", "d") == {"method": "eagle", "num_speculative_tokens": 3}
    assert beam_search.speculative_config("eagle-tree:2:6:3", "d") == {
        "method": "eagle", "model": None, "num_speculative_tokens": 3, "tree": {"top_k": 2, "max_nodes": 6}}


def test_int8_activations_reach_every_configurations_model(tiny_llama_dir, monkeypatch):
    seen = []
    monkeypatch.setattr("specserve.LLM", lambda **kw: seen.append((kw["int8_activations"], "speculative_config" in kw)))
    beam_search._build(tiny_llama_dir, tiny_llama_dir, "plain", 1024, True)
    beam_search._build(tiny_llama_dir, tiny_llama_dir, "draft:2", 1024, 3)
    assert seen == [(True, False), (3, True)]
    with pytest.raises(ValueError, match="off, on or a piece count"):   # before any model loads
        beam_search.run(args(tiny_llama_dir, "plain", spec_bench="", extra=("--int8-activations", "yes")), {})
