"""The suites that run without llama.cpp or a real model, on the tiny random model: each writes one
results file whose table and samples agree. (llama-bench, llama-server and real-pair need llama.cpp's
binaries and real models; serve-load starts servers: those run as `specserve bench SUITE`.)"""
from __future__ import annotations

import os

import pytest

from specserve.bench.command import PRESETS
from specserve.bench.results import read_json, results_files
from specserve.entrypoints.cli import build_parser

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_suite(argv: list[str], results: str, capsys=None) -> dict:
    argv = ["bench", *argv, "--results", results]
    args = build_parser().parse_args(argv)
    assert args.func(args, argv) == 0
    (path,) = results_files(results, argv[1])
    doc = read_json(path)
    if capsys is not None:   # the run's table is printed, then where its file went
        out = capsys.readouterr().out
        assert "| " + " | ".join(doc["table"]["columns"]) + " |" in out and out.rstrip().endswith(f"wrote {path}")
    assert doc["suite"] == argv[1] and doc["command"] == "specserve " + " ".join(argv)
    assert doc["machine"]["cpu"] and doc["commit"]
    return doc


def test_suffix_suite(tiny_llama_dir, tmp_path):
    doc = run_suite(["suffix", "--model", tiny_llama_dir, "--requests", "2", "--max-tokens", "8", "--warmup", "0",
                     "--suffix-k", "4"], str(tmp_path))
    names = ["`plain`", "`ngram k=4 dyn`", "`suffix k=4 dyn`"]
    assert [r[:2] for r in doc["table"]["rows"]] == [[h, n] for h in ("all", "second half") for n in names]
    assert len(doc["samples"]) == 2 * 3 and all(s["tokens"] == 8 for s in doc["samples"])
    plain = [s for s in doc["samples"] if s["config"] == "plain"]
    assert doc["table"]["rows"][0][2] == f"{sum(s['tokens'] for s in plain) / sum(s['seconds'] for s in plain):.1f}"


def test_prefix_cache_suite(tiny_llama_dir, tmp_path):
    doc = run_suite(["prefix-cache", "--model", tiny_llama_dir, "--limit", "3", "--answer-tokens", "4",
                     "--workloads", "system-prompt,long-chat", "--turns", "2", "--max-model-len", "1024"],
                    str(tmp_path))
    rows = doc["table"]["rows"]
    assert [r[:2] for r in rows] == [["shared system prompt", "`plain`"], ["long chat: turns 2-2", "`plain`"]]
    assert rows[0][2] == "2"   # 3 requests, the first (filling the cache) left out
    for row, w in zip(rows, ("system-prompt", "long-chat")):   # the ratio is the samples' mean TTFTs'
        times = doc["samples"][w]["times"]
        off, on = (sum(times[e].values(), []) for e in ("plain/no-caching", "plain/caching"))
        assert row[6] == f"{(sum(off) / len(off)) / (sum(on) / len(on)):.2f}x" and row[2] == str(len(on))
    with pytest.raises(ValueError, match="unknown workloads"):
        run_suite(["prefix-cache", "--model", tiny_llama_dir, "--workloads", "bogus"], str(tmp_path / "x"))


def test_prefix_cache_suite_with_proposers(tiny_llama_dir, tiny_draft_dir, tiny_eagle_dir, tmp_path):
    """Plain, a draft model and EAGLE side by side, timing 3 tokens; the speculating engines with
    caching find the system prompt cached, their proposer's K/V included."""
    draft, eagle = f"draft:3:model={tiny_draft_dir}", f"eagle:3:model={tiny_eagle_dir}"
    doc = run_suite(["prefix-cache", "--model", tiny_llama_dir, "--limit", "3", "--workloads", "system-prompt",
                     "--max-model-len", "1024", "--configs", f"plain,{draft},{eagle}", "--tokens", "3"],
                    str(tmp_path))
    assert [r[1] for r in doc["table"]["rows"]] == ["`plain`", f"`{draft}`", f"`{eagle}`"]
    assert doc["table"]["columns"][4] == "time to 3 tokens without caching (ms)"
    stats = doc["samples"]["prefix_cache_stats"]
    for config in (draft, eagle):
        assert "'hits': 0," in stats[f"{config}/no-caching"] and "'hits': 0," not in stats[f"{config}/caching"]
    doc = run_suite(["prefix-cache", "--model", tiny_llama_dir, "--limit", "2", "--workloads", "system-prompt",
                     "--max-model-len", "1024", "--configs", eagle], str(tmp_path / "eagle-only"))
    assert [r[1] for r in doc["table"]["rows"]] == [f"`{eagle}`"]
    assert doc["table"]["columns"][4] == "TTFT without caching (ms)"


def test_kernels_suite(tmp_path):
    from specserve.model_executor.layers import cpu_attention

    import torch

    if not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("the CPU attention kernel does not build here")
    doc = run_suite(["kernels", "--formats", "Q4_0,Q6_K", "--repeat", "1", "--attention-repeats", "5",
                     "--out", "64", "--in", "256"], str(tmp_path))
    kinds = [r[0] for r in doc["table"]["rows"]]
    assert kinds == ["matmul Q4_0"] * 2 + ["matmul Q6_K"] * 2 + ["attention"] * 5
    assert {s["part"] for s in doc["samples"]} == {"matmul", "attention"}


def test_kernels_suite_times_the_tiles_beside_the_blocks(tmp_path, capsys):
    from gguf import GGMLQuantizationType

    from specserve.model_executor.layers import quant_gemm

    doc = run_suite(["kernels", "--parts", "matmul", "--formats", "Q4_0,Q6_K", "--rows", "1,4", "--tiles",
                     "--repeat", "1", "--out", "64", "--in", "256"], str(tmp_path), capsys)
    kinds = [r[0] for r in doc["table"]["rows"]]
    if quant_gemm.supports_amx(int(GGMLQuantizationType.Q6_K), 64, 256):   # Q4_0 has no tile packing
        assert kinds == ["matmul Q4_0"] * 2 + ["matmul Q6_K", "matmul Q6_K (AMX tiles)"] * 2
        assert [s["tiles_s"] is None for s in doc["samples"]] == [True, True, False, False]
    else:
        assert kinds == ["matmul Q4_0"] * 2 + ["matmul Q6_K"] * 2
    assert [r[1].split(", ")[-1] for r in doc["table"]["rows"]][:2] == ["1 row(s)", "4 row(s)"]


def test_kernels_suite_with_int8_activations(tmp_path, capsys):
    """--int8-activations on: the blocks run the VNNI int8 kernel and the tiles the AMX int8 tiles
    (Q4_K; Q6_K with one piece keeps the VNNI kernel, so it has no tiles row)."""
    from gguf import GGMLQuantizationType

    from specserve.model_executor.layers import quant_gemm

    doc = run_suite(["kernels", "--parts", "matmul", "--formats", "Q4_K,Q6_K", "--rows", "1", "--tiles",
                     "--int8-activations", "on", "--repeat", "1", "--out", "64", "--in", "256"], str(tmp_path), capsys)
    kinds = [r[0] for r in doc["table"]["rows"]]
    if quant_gemm.supports_amx_int8(int(GGMLQuantizationType.Q4_K), 64, 256, 1):
        assert kinds == ["matmul Q4_K (int8 act.)", "matmul Q4_K (AMX tiles, int8 act.)", "matmul Q6_K (int8 act.)"]
    else:
        assert kinds == ["matmul Q4_K (int8 act.)", "matmul Q6_K (int8 act.)"]
    assert doc["params"]["int8_activations"] == "on"


def test_forward_rows_suite(tiny_llama_dir, tmp_path):
    doc = run_suite(["forward-rows", "--models", tiny_llama_dir, "--rows", "3,1", "--rounds", "1",
                     "--context", "20"], str(tmp_path))
    rows = doc["table"]["rows"]
    assert [r[1] for r in rows] == ["1", "3"]                       # sorted row counts, one model
    assert rows[0][3] == "1.00x" and rows[0][4] == "—" and rows[1][4] != "—"
    assert [len(s["ms"]) for s in doc["samples"]] == [2, 2]        # 1 round x 2 timed calls
    with pytest.raises(ValueError, match="row counts"):
        run_suite(["forward-rows", "--models", tiny_llama_dir, "--rows", "0"], str(tmp_path / "x"))


def test_forward_rows_int8_suffix_builds_the_model_with_int8_activations(tiny_llama_dir, tmp_path, monkeypatch):
    import specserve

    seen = []
    real_llm = specserve.LLM

    def recording_llm(*args, **kwargs):
        seen.append((kwargs["model"], kwargs["int8_activations"]))
        return real_llm(*args, **kwargs)

    monkeypatch.setattr(specserve, "LLM", recording_llm)
    doc = run_suite(["forward-rows", "--models", f"{tiny_llama_dir},{tiny_llama_dir}+int8", "--rows", "1",
                     "--rounds", "1", "--context", "20"], str(tmp_path))
    assert seen == [(tiny_llama_dir, False), (tiny_llama_dir, True)]
    assert [r[0] for r in doc["table"]["rows"]] == [tiny_llama_dir, f"{tiny_llama_dir}+int8"]


def test_the_published_batch_scaling_run_is_the_preset():
    """`specserve bench batch-scaling` (the README's command) runs what the published file measured."""
    path = results_files(os.path.join(ROOT, "docs", "bench", "results"), "batch-scaling")[-1]
    s = read_json(path)["params"]
    args = build_parser().parse_args(["bench", "batch-scaling"])
    assert [int(b) for b in args.batch_sizes.split(",")] == s["batch_sizes"] == [1, 8, 32, 64]
    assert set(args.categories.split(",")) == set(s["categories"]) and args.limit == s["limit_per_category"]
    assert args.max_tokens == s["max_tokens"] and args.threads == s["threads"]
    assert [c["name"] for c in s["configs"]] == args.configs.split(",") == PRESETS["batch-scaling"]["configs"].split(",")


def test_forward_rows_suite_on_a_random_shape(tmp_path):
    """shape:NAME models: random weights, the memory limit's share on the 1-row forward."""
    doc = run_suite(["forward-rows", "--models", "shape:tiny,shape:tiny:eager", "--rows", "1,2", "--rounds", "1",
                     "--context", "20", "--device", "cpu", "--dtype", "float32", "--memory-bandwidth", "10",
                     "--chain-steps", "3"], str(tmp_path))
    assert doc["table"]["columns"][-1] == "of the memory limit"
    rows = doc["table"]["rows"]
    assert [r[0] for r in rows] == ["shape:tiny"] * 3 + ["shape:tiny:eager"] * 3
    assert [r[1] for r in rows[:3]] == ["1", "2", "chain 3"]     # 3 greedy steps in a row: a draft's k
    assert rows[0][-1].endswith("%") and rows[1][-1] == rows[2][-1] == "—"
    assert doc["params"]["graphs"] == {"shape:tiny": False, "shape:tiny:eager": False}   # a CPU has none


def test_gpu_steps_is_forward_rows_with_the_gpu_defaults():
    """`specserve bench gpu-steps`: the 8B shape with and without graphs, the 1B shape's 4-step chain
    against it, against the datasheet's memory bandwidth and transformers, on CUDA."""
    args = build_parser().parse_args(["bench", "gpu-steps"])
    assert args.models.split(",")[:3] == ["shape:llama-3.1-8b", "shape:llama-3.1-8b:eager", "shape:llama-3.2-1b"]
    assert (args.device, args.dtype, args.chain_steps, args.memory_bandwidth, args.peer) == \
        ("cuda", "bfloat16", 4, 4800.0, "transformers")
    plain = build_parser().parse_args(["bench", "forward-rows"])   # the suite's own defaults are untouched
    assert plain.device is None and plain.chain_steps == 0 and plain.models.startswith("qwen2.5-coder-1.5b")


def test_attention_suite_compares_the_three_kernels(tmp_path, monkeypatch):
    """`specserve bench attention`: the Triton kernel (here in Triton's interpreter), SDPA over
    gathered blocks and flex_attention with a block mask (eager on a CPU) agree on random blocks
    scattered over the cache, at decode and verification shapes."""
    from triton_interpreter import use_triton_interpreter

    use_triton_interpreter(monkeypatch)
    doc = run_suite(["attention", "--shape", "tiny", "--batches", "1,3", "--rows", "1,4", "--context", "40",
                     "--rounds", "1", "--calls", "1", "--device", "cpu", "--dtype", "float16"], str(tmp_path))
    rows = doc["table"]["rows"]
    assert [(r[0], r[1], r[2]) for r in rows] == [(b, q, k) for b in "13" for q in "14" for k in ("triton", "sdpa", "flex")]
    assert doc["failed"] == {} and all(r[3] != "failed" for r in rows)
    assert set(doc["max_abs_diff_vs_sdpa"]) == {"triton", "sdpa", "flex"}
    assert all(r[5] != "—" for r in rows if r[2] == "flex")          # the block mask's build time
    assert len(doc["samples"]) == 12


def test_attention_suite_fails_when_a_kernel_is_wrong(tmp_path, monkeypatch):
    """Power: a flex mask that also lets a row see the position after its own is caught."""
    from specserve.bench.suites import attention_kernels

    build = attention_kernels.flex_block_mask
    monkeypatch.setattr(attention_kernels, "flex_block_mask",
                        lambda tables, lens, rows, n, device: build(tables, [c + 1 for c in lens], rows, n, device))
    with pytest.raises(AssertionError, match="flex differs from sdpa"):
        run_suite(["attention", "--shape", "tiny", "--batches", "2", "--rows", "3", "--context", "40", "--rounds", "1",
                   "--calls", "1", "--device", "cpu", "--dtype", "float32", "--kernels", "sdpa,flex"], str(tmp_path))


def test_real_pair_configurations_build_what_they_name(monkeypatch):
    import argparse

    import specserve
    from specserve.bench.suites import real_pair

    built = []
    monkeypatch.setattr(specserve, "LLM", lambda **kw: built.append(kw))
    args = argparse.Namespace(target="T", draft="D", draft_vocab_size=None)
    real_pair.build("plain+int8", args)
    real_pair.build("draft:4+int8+dynamic", args)
    real_pair.build("ngram:3", args)
    assert [b["int8_activations"] for b in built] == [True, True, False]
    assert "speculative_config" not in built[0]
    assert built[1]["speculative_config"]["model"] == "D" and built[1]["speculative_config"]["dynamic_k"] is True
    assert built[1]["speculative_config"]["num_speculative_tokens"] == 4
    assert "dynamic_k" not in built[2]["speculative_config"]   # the method's own default
    assert built[1]["speculative_config"]["draft_int8_activations"] is None   # the engine's default
    real_pair.build("draft:3+int8draft", args)
    real_pair.build("draft:3+f32draft", args)
    assert [b["speculative_config"]["draft_int8_activations"] for b in built[3:]] == [True, False]
    real_pair.build("draft:3+v32768", args)
    real_pair.build("draft:3", argparse.Namespace(target="T", draft="D", draft_vocab_size=1000))
    assert [b["speculative_config"]["draft_vocab_size"] for b in built[1:2] + built[5:]] == [None, 32768, 1000]
    for bad in ("draft:3+fast", "draft:3+int8draft+f32draft", "draft:3+v0", "draft:3+v8+v9", "draft:3+vx"):
        with pytest.raises(ValueError, match="suffixes"):
            real_pair.build(bad, args)
