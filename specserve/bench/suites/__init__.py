"""The suites of ``specserve bench``: one question each, one results file per run.

``specserve bench SUITE [options]`` runs a suite; ``specserve bench [options]`` (no suite) is
``spec-bench``. A suite is a module here with ``QUESTION`` (the page's heading), ``EXAMPLE``
(the command the page prints when the suite has no results yet), ``add_arguments(parser)``
and ``run(args, doc)``, which measures and fills the results document's ``params``, ``table``,
``notes`` and ``samples`` (``bench/results.py``); the command line writes the file. The
``spec-bench`` presets (``batch-scaling``, ``gpu``) share ``spec_bench.py``'s runner and
differ only in their defaults, as ``gpu-steps`` shares ``forward_rows.py``'s
(``command.SUITE_DEFAULTS``). Nothing in this module imports torch, so the benchmarks page
(``bench/page.py``) can list the suites cheaply.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    name: str
    module: str        # under specserve.bench.suites
    question: str
    example: str


SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("spec-bench", "spec_bench", "Speculation on Spec-Bench: plain decoding against each proposer",
          "specserve bench --configs plain,ngram:4,draft:3,eagle:4 --batch-sizes 1,8 --limit 1 --max-tokens 64"),
    Suite("batch-scaling", "spec_bench", "Batch scaling: plain against n-gram (dynamic_k) at batches 1 to 64",
          "specserve bench batch-scaling"),
    Suite("serve-load", "serve_load", "Serving load: the OpenAI server under concurrent streams, plain against speculation and llama-server",
          "specserve bench serve-load"),
    Suite("lora-load", "serve_load", "Serving load with LoRA adapters: 32 streaming requests over 4 adapters, "
          "specserve against llama-server with the same adapter files", "specserve bench lora-load --lora ADAPTER.gguf"),
    Suite("llama-bench", "llama_bench", "Plain decoding against llama.cpp (llama-bench), same GGUF file and threads",
          "specserve bench llama-bench"),
    Suite("llama-server", "llama_server", "Chat answers against llama.cpp's llama-server",
          "specserve bench llama-server"),
    Suite("lora", "llama_server", "LoRA adapters: chat answers with one adapter against llama-server --lora, same "
          "GGUF file and adapter file", "specserve bench lora --lora ADAPTER.gguf"),
    Suite("real-pair", "real_pair", "A real target and draft: specserve against llama.cpp's speculative decoding",
          "specserve bench real-pair"),
    Suite("prefix-cache", "prefix_cache", "Prefix caching: time to the first tokens of a resent conversation",
          "specserve bench prefix-cache"),
    Suite("suffix", "suffix", "Suffix decoding on repeated agentic tasks",
          "specserve bench suffix"),
    Suite("cross-vocab", "spec_bench", "Drafts with another tokenizer: Qwen2.5-Coder-1.5B drafted by SmolLM2-135M "
          "and Gemma 3 270M, beside its own 0.5B draft (also forced through the cross-vocabulary path), n-gram and plain",
          "specserve bench cross-vocab"),
    Suite("structured-output", "structured_output", "Structured output: JSON extraction under a schema, constrained "
          "speculation against constrained plain decoding and llama-server's json_schema",
          "specserve bench structured-output"),
    Suite("draft-trees", "spec_bench", "Draft trees against chains: Qwen2.5-Coder-1.5B with its 0.5B draft proposing "
          "trees (top-k and sampled children) and chains of 3 to 5, on coding prompts and Spec-Bench's coding, qa and "
          "writing", "specserve bench draft-trees"),
    Suite("fill-in-middle", "spec_bench", "Fill in the middle: Qwen2.5-Coder-1.5B writing the code between a prefix "
          "and a suffix (12 Python tasks), plain against n-gram and its 0.5B draft",
          "specserve bench fill-in-middle"),
    Suite("editor-infill", "editor_infill", "Code completion as an editor asks for it: /infill on Qwen2.5-Coder-1.5B, "
          "plain and with its 0.5B draft, against llama-server's /infill plain and with the same draft",
          "specserve bench editor-infill"),
    Suite("gpu", "spec_bench", "On a GPU: plain, n-gram and EAGLE against transformers",
          "specserve bench gpu"),
    Suite("gpu-steps", "forward_rows", "On a GPU: decode, verification and draft steps of published shapes (random "
          "weights) with CUDA graphs and without, against the memory limit and transformers",
          "specserve bench gpu-steps"),
    Suite("attention", "attention_kernels", "On a GPU: paged attention at decode and verification shapes, specserve's "
          "Triton kernel against SDPA over gathered blocks and flex_attention with a block mask",
          "specserve bench attention"),
    Suite("beam-search", "beam_search", "Beam search with speculation against plain beam search (B = 4)",
          "specserve bench beam-search"),
    Suite("forward-rows", "forward_rows", "What a forward costs by row count: decode steps against verifications, "
          "for Qwen2.5-Coder-1.5B and its 0.5B draft", "specserve bench forward-rows"),
    Suite("kernels", "kernels", "CPU kernels: GGUF-block matmul and paged attention against their PyTorch paths",
          "specserve bench kernels"),
]}


def suite_module(name: str):
    """The module that runs suite ``name`` (imported on demand: suites import torch)."""
    return importlib.import_module(f"specserve.bench.suites.{SUITES[name].module}")
