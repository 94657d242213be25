"""docs/benchmarks.md is generated from results files: the renderer on a small fixture, the results
files' checks, ``specserve bench page`` and the published page itself."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from specserve.bench.page import render_page
from specserve.bench.results import latest, latest_by_machine_kind, load, new_results, save
from specserve.bench.suites import SUITES, Suite
from specserve.entrypoints.cli import build_parser

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "page_fixture")
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURE_SUITES = {s.name: s for s in [
    Suite("spec-bench", "spec_bench", "Speculation on Spec-Bench: plain decoding against each proposer", "specserve bench"),
    Suite("llama-bench", "llama_bench", "Plain decoding against llama.cpp", "specserve bench llama-bench"),
    Suite("suffix", "suffix", "Suffix decoding on repeated agentic tasks", "specserve bench suffix"),
]}


def test_page_from_the_fixture_equals_the_expected_page():
    """Newest file per suite and machine kind (spec-bench has two on one kind; the page shows the
    2026-01-02 one; llama-bench has one on AVX2 and one on AVX512: both, the newer first), its command,
    machine, commit and table; a registered suite without results is listed with its command."""
    page = render_page(os.path.join(FIXTURE, "results"), None, suites=FIXTURE_SUITES)
    with open(os.path.join(FIXTURE, "benchmarks.md")) as f:
        assert page == f.read()
    assert "specserve bench --limit 2" in page and "--limit 1" not in page and "0000000" not in page
    avx2, avx512 = page.index("llama-bench --rounds 5"), page.index("llama-bench --rounds 3")
    assert avx2 < page.index("On another kind of machine (AVX512)") < avx512
    assert page.count('<a id="llama-bench">') == 1


def test_a_gpu_run_and_a_cpu_run_of_one_suite_are_both_shown(tmp_path):
    shutil.copytree(os.path.join(FIXTURE, "results"), tmp_path / "r")
    doc = load(os.path.join(FIXTURE, "results", "llama-bench", "20260103T000000Z.json"))
    doc["machine"]["cuda"], doc["date"], doc["command"] = "NVIDIA H200", "2026-01-04T00:00:00Z", "on the GPU"
    save(doc, str(tmp_path / "r"))
    runs = latest_by_machine_kind(str(tmp_path / "r"))
    assert [d["command"] for d in runs["llama-bench"]] == [
        "on the GPU", "specserve bench llama-bench --rounds 5", "specserve bench llama-bench --rounds 3"]
    assert [d["command"] for d in runs["spec-bench"]] == ["specserve bench --limit 2"]
    page = render_page(str(tmp_path / "r"), None, suites=FIXTURE_SUITES)
    assert page.index("on the GPU") < page.index("On another kind of machine (AVX2)") < page.index("(AVX512)")


def test_latest_follows_the_date_inside_not_the_file_name(tmp_path):
    shutil.copytree(os.path.join(FIXTURE, "results"), tmp_path / "r")
    old = tmp_path / "r" / "spec-bench" / "20260101T000000Z.json"
    doc = json.loads(old.read_text())
    doc["date"] = "2026-02-01T00:00:00Z"
    old.write_text(json.dumps(doc))
    assert latest(str(tmp_path / "r"))["spec-bench"]["command"] == "specserve bench --limit 1"


def test_a_broken_results_file_fails_loudly(tmp_path):
    doc = load(os.path.join(FIXTURE, "results", "llama-bench", "20260102T010000Z.json"))
    doc["table"]["rows"].append(["one cell"])
    with pytest.raises(ValueError, match="as many cells"):
        save(doc, str(tmp_path))
    del doc["commit"]
    with pytest.raises(ValueError, match="missing commit"):
        save(doc, str(tmp_path))


def test_save_writes_one_file_per_run_under_the_suite(tmp_path):
    doc = new_results("suffix", "q", "specserve bench suffix", {"requests": 2}, machine={"git": "abc", "cpu": "x"})
    doc["table"] = {"columns": ["a"], "rows": [["1"]]}
    first, second = save(doc, str(tmp_path)), save(doc, str(tmp_path))
    assert first != second and os.path.dirname(first) == str(tmp_path / "suffix")
    assert load(second)["commit"] == "abc"


def test_bench_page_command_writes_and_checks(tmp_path):
    out = str(tmp_path / "page.md")
    base = ["bench", "page", "--results", os.path.join(FIXTURE, "results"), "--out", out, "--scripts", str(tmp_path)]
    args = build_parser().parse_args(base)
    assert args.func(args) == 0
    args = build_parser().parse_args(base + ["--check"])
    assert args.func(args) == 0
    with open(out, "a") as f:
        f.write("hand edit\n")
    assert args.func(args) == 1


def test_every_suite_parses_its_options():
    for name in SUITES:
        args = build_parser().parse_args(["bench", name, "--results", "r"])
        assert args.suite == name and args.results == "r"


def test_the_published_page_is_what_its_results_give():
    """docs/benchmarks.md is `specserve bench page`'s output for docs/bench/results and benchmarks/."""
    page = render_page(os.path.join(ROOT, "docs", "bench", "results"), os.path.join(ROOT, "benchmarks"))
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        assert f.read() == page, "run `specserve bench page` after changing docs/bench/results or benchmarks/"
    # a screenful per suite (20), and a table per machine kind (three CPU kinds: AVX2, AVX-512, AVX-512 with AMX;
    # the kernels suite has a table for each since its AMX-tile rows, on AMX five formats by five row counts;
    # draft-trees, beam-search and serve-load show their runs with AMX beside their older ones)
    assert len(page.splitlines()) <= 860


def test_results_are_saved_gzipped_and_read_either_way(tmp_path):
    """save writes <suite>/<date>.json.gz, the same bytes for the same document; load and latest read
    gzipped and plain files alike."""
    doc = load(os.path.join(FIXTURE, "results", "llama-bench", "20260102T010000Z.json"))
    path = save(doc, str(tmp_path / "a"))
    assert path.endswith(os.path.join("llama-bench", "20260102T010000Z.json.gz"))
    assert load(path) == doc
    again = save(doc, str(tmp_path / "b"))
    assert open(path, "rb").read() == open(again, "rb").read()
    shutil.copy(os.path.join(FIXTURE, "results", "llama-bench", "20260102T010000Z.json"),
                tmp_path / "a" / "llama-bench" / "20250101T000000Z.json")   # an older plain file beside it
    assert latest(str(tmp_path / "a"))["llama-bench"] == doc
