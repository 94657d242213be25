"""serve-load's table with llama.cpp's llama-server beside specserve's configurations (the servers
replaced by recorded reports: starting real ones is the suite's run, not a test), and the clear
error when llama-server is not built."""
from __future__ import annotations

import argparse

import pytest

from specserve.bench import load_client as lc
from specserve.bench.suites import serve_load


def args_for(configs: str, tmp_path) -> argparse.Namespace:
    from specserve.entrypoints.cli import build_parser

    return build_parser().parse_args(["bench", "serve-load", "--configs", configs, "--num-requests", "2",
                                      "--llama-bin", str(tmp_path), "--results", str(tmp_path)])


def report(label: str, tokens_per_request: int, wall: float) -> lc.Report:
    return lc.Report(label, [lc.Result(True, tokens_per_request, 0.1, 0.01, 1.0)] * 2, wall)


def test_llama_cpp_is_measured_with_the_same_requests_and_compared(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(serve_load, "load_prompts", lambda path, n: ["a", "b"][:n])
    monkeypatch.setattr(serve_load, "_measure_specserve",
                        lambda config, prompts, args: seen.append((config, prompts)) or report(config, 64, 1.0))
    monkeypatch.setattr(serve_load, "_measure_llama_server",
                        lambda prompts, args: seen.append(("llama.cpp", prompts)) or report("llama.cpp", 64, 2.0))
    doc = {}
    serve_load.run(args_for("plain,ngram:4,llama.cpp", tmp_path), doc)
    assert seen == [("plain", ["a", "b"]), ("ngram:4", ["a", "b"]), ("llama.cpp", ["a", "b"])]
    assert doc["table"]["columns"][-1] == "vs llama.cpp"
    rows = {r[0]: r for r in doc["table"]["rows"]}
    assert rows["`plain`"][3] == "128.0" and rows["`llama.cpp`"][3] == "64.0"
    assert rows["`plain`"][-1] == "2.00x" and rows["`ngram:4`"][-1] == "2.00x" and rows["`llama.cpp`"][-1] == "—"
    assert rows["`llama.cpp`"][4] == "0.50x"          # against specserve plain, as every row
    assert any("llama-server" in note for note in doc["notes"])


def test_without_llama_cpp_the_table_is_specserves_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_load, "load_prompts", lambda path, n: ["a"] * n)
    monkeypatch.setattr(serve_load, "_measure_specserve", lambda config, prompts, args: report(config, 8, 1.0))
    doc = {}
    serve_load.run(args_for("plain,ngram:4", tmp_path), doc)
    assert doc["table"]["columns"] == serve_load.COLUMNS


def test_a_missing_llama_server_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_load, "load_prompts", lambda path, n: ["a"] * n)
    with pytest.raises(RuntimeError, match="llama-server not found: build llama.cpp's tools"):
        serve_load.run(args_for("llama.cpp", tmp_path), {})
