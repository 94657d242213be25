"""editor-infill's run and table with the servers replaced by fakes that answer /infill (starting
real ones is the suite's run, not a test): every configuration gets every task, in rotating
order; the ratios are of median latencies; answers are compared with plain's and llama.cpp's;
a missing llama-server is a clear error."""
from __future__ import annotations

import argparse

import pytest

from specserve.bench.suites import editor_infill


def args_for(configs: str, tmp_path) -> argparse.Namespace:
    from specserve.entrypoints.cli import build_parser

    return build_parser().parse_args(["bench", "editor-infill", "--configs", configs, "--llama-bin", str(tmp_path),
                                      "--results", str(tmp_path)])


class FakeServer:
    def __init__(self, config):
        self.url, self.stopped = config, False

    def stop(self):
        self.stopped = True


def test_each_configuration_answers_every_task_in_rotating_order(tmp_path, monkeypatch):
    calls, started = [], []
    latency = {"plain": 0.2, "draft:4": 0.1, "llama.cpp": 0.4, "llama.cpp+draft:3": 0.3}
    clock = [0.0]

    def fake_start(config, args):
        started.append(FakeServer(config))
        return started[-1]

    def fake_infill(url, prefix, suffix, n_predict):
        calls.append((url, prefix))
        clock[0] += latency[url] if prefix != "def f():\n" else 0.0
        content = "x" if url != "llama.cpp+draft:3" or prefix != "p1" else "y"     # one differing answer
        return {"content": content, "tokens_predicted": 10,
                "timings": {"draft_n": 4, "draft_n_accepted": 3} if "draft" in url else {}}

    monkeypatch.setattr(editor_infill, "_start", fake_start)
    monkeypatch.setattr(editor_infill, "_infill", fake_infill)
    monkeypatch.setattr(editor_infill.time, "perf_counter", lambda: clock[0])
    tasks = [argparse.Namespace(question_id=f"t{i}", text=f"p{i}", suffix="s") for i in range(3)]
    monkeypatch.setattr("specserve.bench.options.load_prompts", lambda path: tasks)
    doc = {}
    editor_infill.run(args_for("plain,draft:4,llama.cpp,llama.cpp+draft:3", tmp_path), doc)
    order = [url for url, prefix in calls if prefix != "def f():\n"]
    configs = ["plain", "draft:4", "llama.cpp", "llama.cpp+draft:3"]
    assert order[:4] == configs and order[4:8] == configs[1:] + configs[:1]
    assert all(s.stopped for s in started)
    rows = {r[0]: r for r in doc["table"]["rows"]}
    assert rows["`draft:4`"][1] == "100" and rows["`draft:4`"][4] == "4.00x" and rows["`draft:4`"][5] == "3.00x"
    assert rows["`llama.cpp`"][4] == "—" and rows["`plain`"][3] == "50.0"
    assert rows["`draft:4`"][6] == "3/3" and rows["`llama.cpp+draft:3`"][7] == "2/3"
    assert rows["`draft:4`"][8] == "0.75" and rows["`plain`"][8] == "—"


def test_a_missing_llama_server_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="llama-server not found: build llama.cpp's tools"):
        editor_infill._start("llama.cpp", args_for("llama.cpp", tmp_path))
    with pytest.raises(ValueError, match="unknown configuration"):
        editor_infill._start("eagle:4", args_for("eagle:4", tmp_path))


def test_int8_configurations_start_servers_with_int8_activations(tmp_path, monkeypatch):
    seen = []

    class Process:
        url = "u"

        def __init__(self, extra, args):
            seen.append(extra)

        def wait_ready(self, timeout):
            pass

    monkeypatch.setattr("specserve.bench.load_client.ServerProcess", Process)
    args = args_for("plain", tmp_path)
    editor_infill._start("draft:3:int8", args)
    editor_infill._start("plain:int8", args)
    editor_infill._start("ngram:4", args)
    assert seen[0] == ["--speculative-model", args.draft_model, "--num-speculative-tokens", "3", "--int8-activations"]
    assert seen[1][-1] == "--int8-activations" and "--int8-activations" not in seen[2]
