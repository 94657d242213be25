"""The llama-bench suite's own parts on the tiny model: specserve's prompt processing (a new prompt
each round, never a prefix-cache hit) and the whole suite against a stand-in ``llama-bench`` that
answers as llama.cpp's does and records the arguments it was given."""
from __future__ import annotations

import json
import os
import stat

import pytest
from proposer_specs import tiny_engine

from specserve.bench.results import read_json, results_files
from specserve.bench.suites.llama_bench import specserve_prefill
from specserve.entrypoints.cli import build_parser


def test_prefill_rounds_take_new_prompts(tiny_llama_dir):
    llm = tiny_engine(tiny_llama_dir, max_num_batched_tokens=64)
    for seed in range(3):
        assert specserve_prefill(llm, 40, seed=seed) > 0
    stats = llm.engine.get_prefix_cache_stats()
    assert stats["enabled"] and stats["queries"] > 0 and stats["hits"] == 0
    with pytest.raises(RuntimeError, match="found in the prefix cache"):
        specserve_prefill(llm, 40, seed=0)   # the same seed: the same prompt, a cache hit, not a prefill
    with pytest.raises(ValueError, match="seed"):
        specserve_prefill(llm, 40, seed=-1)   # random.Random(-1) draws random.Random(1)'s prompt


def fake_llama_bench(folder) -> str:
    """A ``llama-bench`` that logs its argv and answers 100 tok/s for decoding, 400 for a prompt."""
    log = folder / "argv.log"
    script = folder / "llama-bench"
    script.write_text(f"""#!/usr/bin/env python3
import json, sys
open({str(log)!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")
p = sys.argv[sys.argv.index("-p") + 1]
print(json.dumps([{{"avg_ts": 100.0 if p == "0" else 400.0}}]))
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(log)


def test_suite_times_decoding_and_prompts(tiny_llama_dir, tmp_path):
    log = fake_llama_bench(tmp_path)
    argv = ["bench", "llama-bench", "--llama-bin", str(tmp_path), "--models", tiny_llama_dir, "--tokens", "4",
            "--prompt-tokens", "24", "--rounds", "2", "--threads", "1", "--results", str(tmp_path / "results")]
    args = build_parser().parse_args(argv)
    assert args.func(args, argv) == 0
    (path,) = results_files(str(tmp_path / "results"), "llama-bench")
    doc = read_json(path)
    calls = [json.loads(line) for line in open(log)]
    assert [c[c.index("-p") + 1] for c in calls] == ["0", "24"] * 2          # decode then prompt, each round
    assert [c[c.index("-n") + 1] for c in calls] == ["4", "0"] * 2
    cols, (row,) = doc["table"]["columns"], doc["table"]["rows"]
    assert cols[1:4] == ["llama.cpp decode tok/s", "specserve decode tok/s", "specserve / llama.cpp"]
    assert cols[4:7] == ["llama.cpp prompt tok/s (24 tokens)", "specserve prompt tok/s", "specserve prompt / llama.cpp"]
    (sample,) = doc["samples"]
    assert sample["llama_cpp_prompt_tok_s"] == [400.0, 400.0] and len(sample["specserve_prompt_tok_s"]["specserve"]) == 2
    assert row[4] == "400.0" and row[6] == f"{float(row[5]) / 400:.2f}x"
    assert os.path.basename(row[0]) == os.path.basename(tiny_llama_dir)
