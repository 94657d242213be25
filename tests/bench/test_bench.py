"""``specserve bench`` on the tiny random model: the files it writes and the consistency of its numbers."""
from __future__ import annotations

import json
import os
import struct

import pytest

from specserve.bench.runner import ALL, Config, default_prompts_path, load_prompts, parse_configs
from specserve.entrypoints.cli import build_parser

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def two_prompts(path: str) -> str:
    """The first prompt of two categories of the shipped set."""
    rows, seen = [], set()
    with open(default_prompts_path()) as f:
        for line in f:
            row = json.loads(line)
            if row["category"] in ("coding", "qa") and row["category"] not in seen:
                seen.add(row["category"])
                rows.append(row)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args, argv)


def assert_png(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(33)
    assert head[:8] == PNG_MAGIC, path
    assert head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 100 and height > 100


@pytest.fixture(scope="module")
def bench_run(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = str(tmp / "out")
    argv = ["bench", "--model", tiny_llama_dir, "--prompts", two_prompts(str(tmp / "prompts.jsonl")),
            "--configs", "plain,ngram:3", "--batch-sizes", "1,2", "--temperature", "0,0.7", "--max-tokens", "12",
            "--max-model-len", "512", "--kv-cache-memory", str(1 << 24), "--peer", "transformers",
            "--transformers-dtype", "float32", "--no-progress", "--out", out, "--results", str(tmp / "results")]
    assert run_cli(argv) == 0
    with open(os.path.join(out, "results.json")) as f:
        doc = json.load(f)
    return out, argv, doc


def test_bench_writes_report_results_and_plots(bench_run):
    out, argv, doc = bench_run
    for name in ("report.md", "results.json", "speedup_by_category.png", "acceptance_by_position.png",
                 "tok_s_vs_batch_size.png"):
        assert os.path.isfile(os.path.join(out, name)), name
    for name in ("speedup_by_category.png", "acceptance_by_position.png", "tok_s_vs_batch_size.png"):
        assert_png(os.path.join(out, name))
    report = open(os.path.join(out, "report.md")).read()
    assert "specserve " + " ".join(argv) in report          # the exact command
    assert doc["command"] == "specserve " + " ".join(argv)
    assert "## Temperature 0, batch size 1" in report and "## Temperature 0.7, batch size 2" in report
    assert "## Acceptance by draft position" in report
    assert doc["machine"]["cpu"] in report
    assert "torch threads 1" in report
    for image in ("speedup_by_category.png", "acceptance_by_position.png", "tok_s_vs_batch_size.png"):
        assert f"]({image})" in report


def test_bench_writes_one_results_file_for_the_page(bench_run):
    """The suite's results file: the envelope (machine, command, commit), one table row per temperature x
    batch size x configuration (all categories), and the whole run as its raw samples."""
    from specserve.bench.results import latest

    out, argv, doc = bench_run
    files = latest(os.path.join(os.path.dirname(out), "results"))
    r = files["spec-bench"]
    assert r["command"] == "specserve " + " ".join(argv) and r["commit"] == doc["machine"]["git"]
    assert r["machine"] == doc["machine"] and r["samples"] == doc
    assert r["table"]["columns"][:4] == ["temperature", "batch", "configuration", "tok/s"]
    assert len(r["table"]["rows"]) == 2 * 2 * 3
    plain = [row for row in r["table"]["rows"] if row[:3] == ["0", "1", "`plain`"]][0]
    got = [x for x in doc["results"] if (x["temperature"], x["batch_size"], x["category"], x["config"])
           == (0.0, 1, ALL, "plain")][0]
    assert plain[3] == f"{got['tok_s']:.1f}"


def test_bench_results_structure(bench_run):
    _, _, doc = bench_run
    assert doc["schema"] == "specserve-bench/1"
    assert doc["categories"] == ["coding", "qa"]
    assert [c["name"] for c in doc["configs"]] == ["plain", "ngram:3", "transformers"]
    assert [c["kind"] for c in doc["configs"]] == ["specserve", "specserve", "peer"]
    assert doc["configs"][1]["speculative_config"]["method"] == "ngram"
    assert doc["configs"][1]["speculative_config"]["num_speculative_tokens"] == 3
    for key in ("cpu", "cpu_count", "torch_threads", "versions", "loadavg_start", "loadavg_end"):
        assert key in doc["machine"]
    assert set(doc["machine"]["versions"]) >= {"python", "torch", "specserve"}
    s = doc["settings"]
    assert s["batch_sizes"] == [1, 2] and s["temperatures"] == [0.0, 0.7] and s["max_tokens"] == 12
    # One row per temperature x batch size x (category or all) x configuration.
    keys = {(r["temperature"], r["batch_size"], r["category"], r["config"]) for r in doc["results"]}
    assert len(keys) == len(doc["results"]) == 2 * 2 * 3 * 3
    for r in doc["results"]:
        assert r["seconds"] > 0 and r["tok_s"] > 0
        assert r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-3)


def test_bench_numbers_are_consistent(bench_run):
    _, _, doc = bench_run
    idx = {(r["temperature"], r["batch_size"], r["category"], r["config"]): r for r in doc["results"]}
    for (t, bs, cat, name), r in idx.items():
        plain = idx[(t, bs, cat, "plain")]
        # End-of-sequence is ignored: every configuration emits exactly max_tokens per request.
        assert r["tokens"] == plain["tokens"] == r["requests"] * 12
        # Each category's group holds exactly bs requests (one prompt, cycled).
        if cat != ALL:
            assert r["requests"] == bs
        assert r["speedup_vs_plain"] == pytest.approx(r["tok_s"] / plain["tok_s"], rel=1e-3)
        if name == "plain":
            assert r["speedup_vs_plain"] == 1.0
            assert r["spec_decode"] is None
        if name == "ngram:3":
            sd = r["spec_decode"]
            assert sd is not None and sd["mean_acceptance_length"] >= 1.0
            assert sd["num_accepted_tokens"] <= sd["num_draft_tokens"]
            assert sum(sd["accepted_per_position"]) == sd["num_accepted_tokens"]
            assert len(sd["acceptance_by_position"]) <= 3
        # "all" sums the categories.
        if cat == ALL:
            parts = [idx[(t, bs, c, name)] for c in doc["categories"]]
            assert r["tokens"] == sum(p["tokens"] for p in parts)
            assert r["seconds"] == pytest.approx(sum(p["seconds"] for p in parts), abs=1e-3)
    # Greedy speculation is lossless: ngram's answers equal plain decoding's.
    same = {(x["batch_size"], x["config"]): x for x in doc["identical_to_plain"]}
    for bs in (1, 2):
        assert same[(bs, "ngram:3")]["identical"] == same[(bs, "ngram:3")]["requests"] == 2 * bs
    # Per-request records: every configuration answered every request of every unit.
    per = doc["per_request"]
    assert len(per) == 2 * (2 * 1 + 2 * 2) * 3
    assert all(r["num_tokens"] == len(r["token_ids"]) == 12 for r in per)


def test_parse_configs():
    configs = parse_configs("ngram:4,draft:3,eagle", draft_model="/d")
    assert [c.name for c in configs] == ["plain", "ngram:4", "draft:3", "eagle"]   # plain added first
    assert configs[1].speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert configs[2].speculative_config == {"method": "draft_model", "num_speculative_tokens": 3, "model": "/d"}
    assert configs[3].speculative_config == {"method": "eagle"}   # the shipped head and its own k
    assert parse_configs("plain") == [Config("plain", "specserve")]
    dynamic = parse_configs("ngram:6:dynamic,suffix:8")
    assert dynamic[1].speculative_config == {"method": "ngram", "num_speculative_tokens": 6, "dynamic_k": True}
    assert dynamic[2].speculative_config == {"method": "suffix", "num_speculative_tokens": 8}
    assert parse_configs("ngram:4:fixed")[1].speculative_config == {"method": "ngram", "num_speculative_tokens": 4,
                                                                    "dynamic_k": False}
    for bad in ("medusa:3", "ngram:x", "ngram:0", "plain,plain", "eagle3:2"):   # eagle3 needs its head's folder
        with pytest.raises(ValueError):
            parse_configs(bad)
    both = parse_configs("eagle:1,eagle3:3", eagle_model="/e1", eagle3_model="/e3")
    assert both[1].speculative_config == {"method": "eagle", "num_speculative_tokens": 1, "model": "/e1"}
    assert both[2].speculative_config == {"method": "eagle3", "num_speculative_tokens": 3, "model": "/e3"}


def test_int8_activations_option_reaches_every_configurations_engine(monkeypatch):
    from specserve.bench import engines
    from specserve.bench.command import options_from_args
    from specserve.bench.options import parse_int8_activations

    assert [parse_int8_activations(w) for w in ("off", "on", "2", " 3", "4")] == [False, True, 2, 3, 4]
    for bad in ("1", "5", "yes", ""):
        with pytest.raises(ValueError, match="off, on or a piece count"):
            parse_int8_activations(bad)
    argv = ["bench", "draft-trees", "--configs", "plain,ngram:3", "--int8-activations", "on"]
    opts = options_from_args(build_parser().parse_args(argv), argv)
    assert opts.int8_activations is True
    seen = []
    monkeypatch.setattr("specserve.LLM", lambda **kw: seen.append(kw["int8_activations"]) or _NoEngine())
    for config in opts.configs:
        engines.SpecserveEngine(config, opts)
    assert seen == [True, True]


class _NoEngine:
    engine = None


def test_load_prompts_limit_and_categories(tmp_path):
    prompts = load_prompts(None, limit=1)
    cats = [p.category for p in prompts]
    assert len(cats) == len(set(cats)) == 13      # the shipped set: Spec-Bench's 13 categories
    assert len(load_prompts(None)) == 39
    assert [p.category for p in load_prompts(None, categories=["rag"])] == ["rag"] * 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["x"]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompts(str(bad))
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(None, categories=["nope"])


def test_load_prompts_joins_sources_with_plus(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"question_id": "a1", "category": "x", "turns": ["p"]}\n{"question_id": "a2", "category": "x", "turns": ["q"]}\n')
    b.write_text('{"question_id": "b1", "category": "y", "turns": ["r"]}\n{"question_id": "b2", "category": "x", "turns": ["s"]}\n')
    assert [p.question_id for p in load_prompts(f"{a}+{b}")] == ["a1", "a2", "b1", "b2"]
    assert [p.question_id for p in load_prompts(f"{a}+{b}", limit=1)] == ["a1", "b1"]   # the limit spans sources


def test_llama_cpp_peer_without_binaries_says_how_to_build(tmp_path):
    from specserve.bench.peers import LlamaCppPeer
    from specserve.bench.runner import BenchOptions

    with pytest.raises(ValueError, match="build-llamacpp.sh"):
        LlamaCppPeer(BenchOptions(llama_cpp_bin=str(tmp_path)))


def test_bench_decode_tok_s(bench_run):
    out, _, doc = bench_run
    idx = {(r["temperature"], r["batch_size"], r["category"], r["config"]): r for r in doc["results"]}
    for (t, bs, cat, name), r in idx.items():
        if name == "transformers":   # measured from outside: no first-token times
            assert r["decode_tok_s"] is None and r["decode_speedup_vs_plain"] is None
            continue
        assert r["decode_tok_s"] > 0
        plain = idx[(t, bs, cat, "plain")]
        assert r["decode_speedup_vs_plain"] == pytest.approx(r["decode_tok_s"] / plain["decode_tok_s"], rel=1e-3)
    report = open(os.path.join(out, "report.md")).read()
    assert "## Decode tok/s, prefill excluded (all categories)" in report
    assert "ngram:3 decode speedup" in report


def test_parse_configs_options():
    tree, chain = parse_configs("ngram:5:prompt_lookup_max=5:tree,ngram:5:prompt_lookup_max=5")[1:]
    assert tree.name == "ngram:5:prompt_lookup_max=5:tree"
    assert tree.speculative_config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5,
                                       "prompt_lookup_tree": True}
    assert chain.speculative_config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5}
    assert parse_configs("ngram:tree")[1].speculative_config == {"method": "ngram", "prompt_lookup_tree": True}
    draft = parse_configs("draft:3:prompt_lookup_adaptive=false:disable_by_batch_size=4", draft_model="/d")[1]
    assert draft.speculative_config == {"method": "draft_model", "num_speculative_tokens": 3, "model": "/d",
                                        "prompt_lookup_adaptive": False, "disable_by_batch_size": 4}
    for bad, match in (("ngram:4:bogus=1", "unknown speculative_config keys"), ("ngram:4:fast", "KEY=VALUE"),
                       ("draft:3:tree", "ngram option"), ("ngram:4:prompt_lookup_min=5", "prompt_lookup_min"),
                       ("ngram:4:num_speculative_tokens=2", "K goes right after")):
        with pytest.raises(ValueError, match=match):
            parse_configs(bad)


def test_start_llama_server_reports_an_early_exit(tmp_path):
    """The llama-server start shared by the llama.cpp peer and the llama-server and real-pair suites."""
    from specserve.bench.peers import start_llama_server

    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nexit 3\n")
    exe.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        start_llama_server(str(exe), "model.gguf", threads=1, ctx_size=512, timeout_s=30)


@pytest.mark.default_dynamic_k
def test_configuration_labels_say_when_ngram_drafts_a_fixed_k():
    from specserve.bench.report import _spec_text

    assert "dynamic_k=False" in _spec_text({"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": False})
    assert "dynamic_k" not in _spec_text({"method": "ngram", "num_speculative_tokens": 4})   # the default
    assert "dynamic_k=True" in _spec_text({"method": "draft_model", "model": "/d", "dynamic_k": True})


def test_transformers_drafting_peers(tiny_llama_dir, tiny_draft_dir, tmp_path):
    """transformers' assisted generation (--draft-model as assistant_model) and prompt lookup: each
    peer one prompt at a time, greedy answers compared with plain decoding's."""
    argv = ["bench", "--model", tiny_llama_dir, "--prompts", two_prompts(str(tmp_path / "prompts.jsonl")),
            "--configs", "plain", "--batch-sizes", "2", "--max-tokens", "8", "--max-model-len", "512",
            "--kv-cache-memory", str(1 << 24), "--peer", "transformers-assisted", "--peer", "transformers-ngram",
            "--draft-model", tiny_draft_dir, "--transformers-dtype", "float32", "--no-progress",
            "--out", str(tmp_path / "out")]
    assert run_cli(argv) == 0
    with open(tmp_path / "out" / "results.json") as f:
        doc = json.load(f)
    configs = {c["name"]: c for c in doc["configs"]}
    assert list(configs) == ["plain", "transformers-assisted", "transformers-ngram:4"]
    assert tiny_draft_dir in configs["transformers-assisted"]["description"]
    rows = {r["config"]: r for r in doc["results"] if r["category"] == ALL}
    assert rows["transformers-assisted"]["tok_s"] > 0 and rows["transformers-ngram:4"]["tok_s"] > 0


def test_check_room_for_stops_before_memory_runs_out():
    from specserve.bench.runner import check_room_for

    gib = 1 << 30
    rest = [Config("draft:4", "specserve"), Config("draft:5", "specserve")]
    with pytest.raises(MemoryError, match=r"2 more bench configurations: 'draft:3' took 3\.0 GiB.*draft:4, draft:5.*"
                                          r"6\.0 GiB and 5\.0 GiB is available"):
        check_room_for(rest, "draft:3", 1 * gib, 4 * gib, 5 * gib)
    check_room_for(rest, "draft:3", 1 * gib, 4 * gib, 6 * gib)        # exactly enough
    check_room_for([], "draft:3", 1 * gib, 4 * gib, 0)                 # nothing left to build
    check_room_for(rest, "draft:3", None, 4 * gib, 0)                  # sizes unknown: no check
    check_room_for(rest, "draft:3", 1 * gib, 4 * gib, None)


def test_build_engines_closes_what_it_built_when_memory_would_run_out(monkeypatch):
    from specserve.bench import runner
    from specserve.bench.runner import BenchOptions

    built, closed, rss = [], [], iter(range(0, 100, 10))

    class FakeEngine:
        def __init__(self, config, opts):
            self.name = config.name
            built.append(self.name)

        def close(self):
            closed.append(self.name)

    monkeypatch.setattr(runner, "SpecserveEngine", FakeEngine)
    monkeypatch.setattr(runner, "process_memory", lambda: next(rss) << 30)   # each engine takes 10 GiB
    available = iter([35 << 30, 15 << 30])   # room for 3 more after the first engine, not 2 after the second
    monkeypatch.setattr(runner, "memory_available", lambda: next(available))
    opts = BenchOptions(configs=parse_configs("plain,ngram:2,ngram:3,ngram:4"))
    with pytest.raises(MemoryError, match="ngram:3, ngram:4 would need about 20.0 GiB"):
        runner.build_engines(opts)
    assert built == ["plain", "ngram:2"] and closed == built


def test_fill_in_middle_tasks(tiny_fim_dir, tmp_path):
    """The shipped infill tasks load with their suffixes; the runner builds their prompts with the
    model's markers and ends their answers at its end-of-middle tokens (--stop-at-eos)."""
    import datetime

    from specserve.bench.options import BenchOptions
    from specserve.bench.runner import _run, build_engines
    from specserve.entrypoints.fill_in_middle import fim_prompt, fim_tokens

    tasks = load_prompts("fill-in-middle")
    assert len(tasks) == 12 and all(t.suffix for t in tasks)
    opts = BenchOptions(model=tiny_fim_dir, dtype="float32", configs=parse_configs("plain,ngram:3"), max_tokens=4,
                        stop_at_eos=True, kv_cache_memory=8 << 20, max_model_len=512, prompts_path="fill-in-middle",
                        limit=1)
    prompts = load_prompts(opts.prompts_path, None, opts.limit)
    engines = build_engines(opts)
    try:
        doc = _run(opts, prompts, engines, {}, datetime.datetime.now(datetime.timezone.utc))
    finally:
        for e in engines:
            e.close()
    tok = engines[0].tokenizer()
    assert prompts[0].token_ids == fim_prompt(tok, prompts[0].text, prompts[0].suffix)
    assert prompts[0].stop_token_ids == list(fim_tokens(tok).ends)
    same = {x["config"]: x for x in doc["identical_to_plain"]}
    assert same["ngram:3"]["identical"] == same["ngram:3"]["requests"] == 3    # one task per category
