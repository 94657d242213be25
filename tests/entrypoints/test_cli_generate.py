"""``specserve generate`` with the sampling flags (--n, penalties) and the prefix-caching
switch, on the tiny random model."""
from __future__ import annotations

import json
import math

import pytest

from specserve.config import EngineConfig
from specserve.entrypoints.cli import build_parser, main
from specserve.entrypoints.engine_args import build_llm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prefix_caching_is_on_unless_switched_off():
    parse = build_parser().parse_args
    assert parse(["generate", "x"]).enable_prefix_caching is True
    assert parse(["generate", "x", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_batch_flags_reach_the_engine_with_its_defaults():
    parse = build_parser().parse_args
    for command in (["generate", "x"], ["serve"]):
        args = parse(command)
        assert (args.max_num_seqs, args.max_num_batched_tokens, args.block_size) == (
            EngineConfig.max_num_seqs, EngineConfig.max_num_batched_tokens, EngineConfig.block_size)


def test_batch_flags_and_the_servers_seed_size_the_engine(tiny_llama_dir):
    args = build_parser().parse_args(["serve", "--model", tiny_llama_dir, "--dtype", "float32", "--max-num-seqs", "3",
                                      "--max-num-batched-tokens", "64", "--block-size", "8", "--seed", "7",
                                      "--kv-cache-memory", str(8 << 20)])
    config = build_llm(args).engine.config
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size, config.seed) == (3, 64, 8, 7)
    assert build_parser().parse_args(["serve"]).engine_seed == EngineConfig.seed


@pytest.mark.parametrize("flag", ["--max-num-seqs", "--max-num-batched-tokens", "--block-size"])
def test_a_bad_batch_flag_is_a_clear_error(tiny_llama_dir, capsys, flag):
    code = main(["generate", "x", "--model", tiny_llama_dir, flag, "0"])
    assert code == 2
    assert f"{flag[2:].replace('-', '_')} must be a positive integer, got 0" in capsys.readouterr().err


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
    assert main(args + ["--no-speculation"]) == 0
    assert "[speculation" not in capsys.readouterr().err


def test_compare_plain_adds_the_speed_against_plain_decoding(tiny_llama_dir, capsys):
    """--compare-plain answers again on a plain engine and puts the ratio in the summary line; the
    answer printed is the speculative one, and greedy, it is plain's anyway."""
    args = ["generate", "one two three one two three one two", "--model", tiny_llama_dir, "--dtype", "float32",
            "--max-tokens", "12", "--kv-cache-memory", str(8 << 20)]
    assert main(args + ["--no-speculation"]) == 0
    plain_out = capsys.readouterr().out
    assert main(args + ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--compare-plain"]) == 0
    out, err = capsys.readouterr()
    assert out == plain_out
    line = [x for x in err.splitlines() if x.startswith("[speculation: ngram]")]
    assert len(line) == 1 and "x plain's" in line[0]


def test_no_speculation_with_speculation_flags_is_an_error(tiny_llama_dir):
    with pytest.raises(SystemExit, match="--no-speculation with speculation flags"):
        main(["generate", "x", "--model", tiny_llama_dir, "--no-speculation", "--speculative-method", "ngram"])


def test_structured_output_flags(tiny_llama_dir, tmp_path, capsys):
    """--json-schema FILE, --regex, --grammar FILE, --choice: the answer follows each; two at once,
    an unreadable file or an invalid constraint is a clear error."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                  "required": ["n"], "additionalProperties": False}))
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "x" [0-9] [0-9]')
    base = ["generate", "answer:", "--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", "20",
            "--kv-cache-memory", str(8 << 20), "--temperature", "1.0", "--seed", "3"]
    checks = [
        (["--json-schema", str(schema)], lambda t: 0 <= json.loads(t)["n"] <= 9),
        (["--regex", "[a-c]{3}"], lambda t: len(t) == 3 and set(t) <= set("abc")),
        (["--grammar", str(grammar), "--speculative-method", "grammar"], lambda t: t[0] == "x" and t[1:].isdigit()),
        (["--choice", "left", "--choice", "right"], lambda t: t in ("left", "right")),
    ]
    for flags, check in checks:
        assert main(base + flags) == 0
        assert check(capsys.readouterr().out.splitlines()[0]), flags
    for flags, message in [(["--regex", "a", "--choice", "a"], "one of --json-schema"),
                           (["--json-schema", str(tmp_path / "missing.json")], "missing.json")]:
        with pytest.raises(SystemExit, match=message):
            main(base + flags)
    assert main(base + ["--regex", "(a"]) == 2
    assert "invalid regex" in capsys.readouterr().err


def test_beam_width_prints_every_beam_and_compares_with_plain_beam_search(tiny_llama_dir, capsys):
    # the default dtype: speculative beams equal plain's bit for bit (docs/architecture.md, "Numerics")
    base = ["generate", "one two three one two three", "--model", tiny_llama_dir,
            "--max-tokens", "6", "--kv-cache-memory", str(8 << 20), "--beam-width", "3"]
    assert main(base + ["--json", "--no-speculation"]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["index"] for d in docs] == [0, 1, 2]
    assert [d["score"] for d in docs] == sorted((d["score"] for d in docs), reverse=True)   # best first
    assert len({tuple(d["token_ids"]) for d in docs}) == 3 and all(len(d["token_ids"]) <= 6 for d in docs)
    assert main(base + ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--compare-plain"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("--- beam ") == 3
    assert "beams identical to plain beam search's" in captured.err


def test_beam_width_refuses_sampling_flags(tiny_llama_dir, capsys):
    code = main(["generate", "x", "--model", tiny_llama_dir, "--beam-width", "2", "--temperature", "0.7", "--n", "2"])
    assert code == 2
    assert "--beam-width takes none of --temperature, --n" in capsys.readouterr().err


def test_how_beams_compare_with_plain_beam_search():
    from types import SimpleNamespace

    from specserve.entrypoints.generate_cmd import _same_beams

    def out(*beams):
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=t, cum_logprob=c) for t, c in beams])

    plain = out(([1, 2], -1.0), ([1, 3], -2.0))
    assert _same_beams(plain, out(([1, 2], -1.0), ([1, 3], -2.0))) == "beams identical to plain beam search's"
    assert "scores within 1.0e-06" in _same_beams(plain, out(([1, 2], -1.000001), ([1, 3], -2.0)))
    assert "DIFFERENT" in _same_beams(plain, out(([1, 3], -2.0), ([1, 2], -1.0)))


def test_prompt_logprobs_print_the_prompts_perplexity_and_its_entries_in_json(tiny_llama_dir, capsys):
    args = ["generate", "one two three four five", "--model", tiny_llama_dir, "--dtype", "float32", "--max-tokens", "2",
            "--prompt-logprobs", "1", "--kv-cache-memory", str(8 << 20)]
    assert main(args) == 0
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[prompt]")]
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    entries = doc["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(doc["prompt_token_ids"])
    lps = [entry[str(t)] for entry, t in zip(entries[1:], doc["prompt_token_ids"][1:])]
    assert f"{len(lps)} tokens scored: perplexity {math.exp(-sum(lps) / len(lps)):.3f}" in line


def test_speculative_config_json_as_vllm_takes_it():
    from specserve.entrypoints.engine_args import speculative_config_from_args

    def config(*flags):
        return speculative_config_from_args(build_parser().parse_args(["generate", "x", *flags]))

    whole = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    assert config("--speculative-config", whole) == {"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_max": 2}
    assert config("--speculative-config", whole, "--prompt-lookup-min", "2")["prompt_lookup_min"] == 2
    assert config("--speculative-config", whole, "--num-speculative-tokens", "3")["num_speculative_tokens"] == 3
    with pytest.raises(SystemExit, match="disagree on num_speculative_tokens"):
        config("--speculative-config", whole, "--num-speculative-tokens", "4")
    with pytest.raises(SystemExit):
        config("--speculative-config", whole, "--no-speculation")


def test_vllms_serve_flags_are_accepted(tiny_llama_dir, caplog):
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                      "--trust-remote-code", "--gpu-memory-utilization", "0.85"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json" and args.trust_remote_code
    assert args.gpu_memory_utilization == 0.85
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--gpu-memory-utilization", "1.5"])
    from specserve import LLM

    with caplog.at_level("WARNING"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20,
                  trust_remote_code=True, gpu_memory_utilization=0.85, tokenizer="some/hf-tokenizer")
    assert llm.engine is not None and "gpu_memory_utilization=0.85 is not applied" in caplog.text
    assert "tokenizer='some/hf-tokenizer' is not used" in caplog.text
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(model=tiny_llama_dir, gpu_memory_utilization=0)


def test_a_vllm_serve_command_line_runs_as_it_is():
    """The flags of a typical `vllm serve` line parse; those that change nothing here say why,
    and a value specserve cannot honour stops the start naming the values allowed."""
    line = ("serve --host 0.0.0.0 --port 8000 --gpu-memory-utilization 0.9 --max-model-len 4096 --enable-prefix-caching "
            "--disable-log-requests --disable-log-stats --enable-chunked-prefill --swap-space 4 --kv-cache-dtype auto "
            "--quantization gguf --uvicorn-log-level warning --disable-fastapi-docs --served-model-name m "
            "--enable-auto-tool-choice --tool-call-parser hermes --trust-remote-code --tokenizer Qwen/Qwen2.5-0.5B")
    args = build_parser().parse_args(line.split())
    assert args.log_level == "warning" and args.max_model_len == 4096 and args.served_model_name == ["m"]
    for bad in ("--kv-cache-dtype fp8", "--quantization awq"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad.split()])


def test_lora_runs_the_command_with_the_adapter(peaked_llama_dir, tmp_path, capsys):
    """``--lora DIR`` (llama-cli's flag): generate's tokens are the LLM API's with that adapter, and
    differ from the base model's; chat takes the flag too."""
    from specserve import LLM, LoRARequest, SamplingParams
    from lora_adapters import write_peft_adapter

    adapter = write_peft_adapter(peaked_llama_dir, str(tmp_path / "a"), seed=1)
    common = ["--model", peaked_llama_dir, "--dtype", "float32", "--max-tokens", "8", "--temperature", "0",
              "--json", "--kv-cache-memory", str(8 << 20)]
    assert main(["generate", "Hello there", "--lora", adapter, *common]) == 0
    got = json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"]
    llm = LLM(peaked_llama_dir, dtype="float32", kv_cache_memory=8 << 20, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert got == llm.generate("Hello there", params, lora_request=LoRARequest("a", 1, adapter))[0].outputs[0].token_ids
    assert got != llm.generate("Hello there", params)[0].outputs[0].token_ids
    assert build_parser().parse_args(["chat", "--lora", adapter]).lora == adapter
