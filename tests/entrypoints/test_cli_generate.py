"""``specserve generate`` with the sampling flags (--n, penalties) and the prefix-caching
switch, on the tiny random model."""
from __future__ import annotations

import json

import pytest

from specserve.entrypoints.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prefix_caching_is_on_unless_switched_off():
    parse = build_parser().parse_args
    assert parse(["generate", "x"]).enable_prefix_caching is True
    assert parse(["generate", "x", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_n_samples_print_one_json_line_each(tiny_llama_dir, capsys):
    code = main(["generate", "one two three", "--model", tiny_llama_dir, "--dtype", "float32", "--n", "3",
                 "--temperature", "1.0", "--seed", "4", "--max-tokens", "5", "--repetition-penalty", "1.2",
                 "--frequency-penalty", "0.5", "--json", "--kv-cache-memory", str(8 << 20)])
    assert code == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["index"] for d in docs] == [0, 1, 2]
    assert all(len(d["token_ids"]) == 5 for d in docs)


def test_a_bad_penalty_is_a_clear_error(tiny_llama_dir, capsys):
    code = main(["generate", "x", "--model", tiny_llama_dir, "--presence-penalty", "5"])
    assert code == 2
    assert "presence_penalty must be a number in [-2, 2]" in capsys.readouterr().err


def test_speculation_prints_one_summary_line_after_the_answer(tiny_llama_dir, capsys):
    """With a proposer, the answer goes to stdout and one line of what speculation did to stderr;
    without one, no such line."""
    args = ["generate", "one two three one two three one two", "--model", tiny_llama_dir, "--dtype", "float32",
            "--max-tokens", "12", "--kv-cache-memory", str(8 << 20)]
    assert main(args + ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "[speculation: ngram]" not in out
    line = [x for x in err.splitlines() if x.startswith("[speculation: ngram]")]
    assert len(line) == 1 and "drafted tokens accepted" in line[0] and "tok/s" in line[0]
    assert main(args) == 0
    assert "[speculation" not in capsys.readouterr().err
