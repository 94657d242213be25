"""What every engine-building command shares: the model and speculation flags, and args -> ``LLM``.

``specserve generate`` and ``specserve serve`` (``openai/serve.py``) build their engine
here, so neither command module imports the other.
"""
from __future__ import annotations

import argparse
import json

from specserve.config import EngineConfig, SpeculativeConfig
from specserve.entrypoints.chat_template import load_chat_template

# What `generate` and `serve` speculate with when no speculation flag is given (None: plain
# decoding). Chosen by measurement: docs/benchmarks.md, "Batch scaling" and "Serving load".
DEFAULT_SPECULATION: dict | None = None
NO_SPECULATION_FLAG = "--no-speculation"


def fraction(text: str) -> float:
    """A number in (0, 1] (argparse type)."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def lora_module(text: str) -> tuple[str, str]:
    """``--lora-modules`` item (argparse type): ``NAME=PATH`` or vLLM's JSON ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError('a JSON module needs "name" and "path" strings')
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return name, path


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that builds an engine."""
    p.add_argument("--model", default=None, help="a .gguf file, a Hugging Face folder, a catalog name (`specserve models`) or a cached hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto (float16 weights with float32 activations on x86 CPUs, else float32; bfloat16 on GPU), bfloat16, float16 or float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes of KV cache")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="requests running at once at most (the batch size); more wait in the queue")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="tokens a step at most: prefill chunks, decoding and verified draft tokens together")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens a KV cache block holds")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template's text) used instead of the model's own")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines and changes nothing: specserve runs its own model code, "
                        "never code from a model's folder")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=None, metavar="FRACTION",
                   help="accepted for vLLM's command lines and not applied: specserve sizes the KV cache by "
                        "--kv-cache-memory (bytes); a warning says so")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for requests that leave a field out: auto (the model's "
                        "generation_config.json or GGUF general.sampling.* metadata), vllm (none), or a folder "
                        "holding a generation_config.json")
    p.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help="sampling defaults set on top, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 256}'")
    p.add_argument("--enforce-eager", action="store_true",
                   help="GPU: run every step op by op instead of replaying captured CUDA graphs")
    p.add_argument("--pooling", choices=["last", "mean", "cls"], default=EngineConfig.pooling,
                   help="embeddings (/v1/embeddings, LLM.embed): the prompt's final hidden states pooled by the last "
                        "token's, their mean or the first token's")
    p.add_argument("--enable-lora", action="store_true",
                   help="let requests run with PEFT LoRA adapters (serve: --lora-modules, or 'model' naming one)")
    p.add_argument("--max-loras", type=int, default=EngineConfig.max_loras,
                   help="LoRA adapters in one step at most (requests of another wait)")
    p.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank,
                   help="the largest LoRA rank an adapter may have")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters kept loaded at most while no request uses them (default: --max-loras)")
    p.add_argument(NO_SPECULATION_FLAG, dest="no_speculation", action="store_true",
                   help="plain decoding, whatever the default speculation is")
    p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help="the speculative config as one JSON object, as vLLM's flag takes it: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (SpeculativeConfig's keys); "
                        "the flags below may add keys, not contradict it")
    p.add_argument("--speculative-model", default=None, help="draft model (anything --model accepts)")
    p.add_argument("--speculative-method", default=None, choices=["draft_model", "ngram", "eagle", "eagle3", "suffix", "grammar"],
                   help="grammar: no proposer, only the forced tokens of constrained requests' grammars as drafts")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k, draft tokens per step (default: an EAGLE head's own k; suffix: its tree depth, 16; else 4)")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest suffix to match")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest suffix to match")
    p.add_argument("--prompt-lookup-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="ngram: propose min(k, match length) tokens (default) rather than always k")
    p.add_argument("--prompt-lookup-tree", action=argparse.BooleanOptionalAction, default=None,
                   help="ngram: propose several earlier continuations as a tree of at most k tokens")
    p.add_argument("--speculative-tree", default=None, metavar="TOP_K/MAX_NODES[/MAX_DEPTH][/sampled][/dynamic]",
                   help="draft_model / eagle: propose a tree of drafts, e.g. 4/16 (SpeculativeConfig.tree; depth "
                        "defaults to --num-speculative-tokens)")
    p.add_argument("--suffix-max-depth", type=int, default=None, help="suffix: the draft tree's depth at most")
    p.add_argument("--suffix-min-token-prob", type=float, default=None,
                   help="suffix: smallest (count-based) probability of a draft token")
    p.add_argument("--suffix-max-cached-requests", type=int, default=None,
                   help="suffix: recent requests the global suffix trie keeps (0: only each request's own)")
    p.add_argument("--suffix-max-spec-factor", type=float, default=None,
                   help="suffix: at most this many draft tokens per matched token (default 1)")
    p.add_argument("--speculative-dynamic-k", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each request's draft length every step from measured costs and acceptance "
                        "(--num-speculative-tokens is the maximum; default: on for ngram and suffix, off otherwise)")
    p.add_argument("--grammar-drafts", action=argparse.BooleanOptionalAction, default=None,
                   help="structured output: add the tokens a request's grammar forces to the proposer's drafts "
                        "(default: on)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="skip drafting in steps with at least this many decoding requests")
    p.add_argument("--draft-tensor-parallel-size", type=int, default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft_model: the draft proposes only the first N token ids (a cheaper LM head)")
    p.add_argument("--draft-quantization", choices=SpeculativeConfig.DRAFT_QUANTIZATIONS, default=None,
                   help="draft_model: requantize the draft's GGUF blocks to this format at load (fewer bytes "
                        "a draft step; output unchanged)")
    p.add_argument("--speculative-cross-vocab", choices=SpeculativeConfig.CROSS_VOCAB_METHODS, default=None,
                   help="draft_model: how a draft with another tokenizer drafts (slem: its text tokenized again "
                        "for the target; tli: its distribution on the tokens both vocabularies share); default: "
                        "tli when the tokenizers differ; naming one forces it on any draft")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of earlier requests' identical prefixes (default: on)")
    p.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=False,
                   help="CPU, GGUF blocks: multiply with activations rounded to 8 bits (AMX int8 tiles, AVX-512 VNNI "
                        "or AVX2; faster, llama.cpp's numbers rather than float32 activations)")
    p.add_argument("--int8-activation-pieces", type=int, default=None, metavar="N",
                   help="CPU, GGUF blocks: int8 activations as N pieces summed (1-4; 3 = float32's precision; on CPUs "
                        "with AMX int8 tiles, 16 / N rows a tile pass, else fastest 1-row decoding, slower verification "
                        "and prefill)")
    p.add_argument("--draft-int8-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="draft_model: the same for the draft (default: on, except where an AMX build lacks int8 tiles; "
                        "the draft only guesses, output is unchanged)")


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (``{"temperature": 0.5}``)."""
    value = _json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def json_string_list(text: str) -> list[str]:
    """An argparse type: a JSON list of strings (``["http://localhost:3000"]``), as vLLM's list flags take."""
    value = _json(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"a JSON list of strings is needed, got {text!r}")
    return value


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def speculative_config_from_args(args) -> dict | None:
    values = {
        "method": args.speculative_method,
        "model": args.speculative_model,
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_adaptive": args.prompt_lookup_adaptive,
        "prompt_lookup_tree": args.prompt_lookup_tree,
        "tree": getattr(args, "speculative_tree", None),
        "suffix_max_depth": getattr(args, "suffix_max_depth", None),
        "suffix_min_token_prob": getattr(args, "suffix_min_token_prob", None),
        "suffix_max_cached_requests": getattr(args, "suffix_max_cached_requests", None),
        "suffix_max_spec_factor": getattr(args, "suffix_max_spec_factor", None),
        "draft_tensor_parallel_size": args.draft_tensor_parallel_size,
        "draft_vocab_size": getattr(args, "draft_vocab_size", None),
        "draft_quantization": getattr(args, "draft_quantization", None),
        "draft_int8_activations": getattr(args, "draft_int8_activations", None),
        "cross_vocab": getattr(args, "speculative_cross_vocab", None),
        "disable_by_batch_size": args.speculative_disable_by_batch_size,
        "dynamic_k": getattr(args, "speculative_dynamic_k", None),
        "grammar_drafts": getattr(args, "grammar_drafts", None),
    }
    values = {k: v for k, v in values.items() if v is not None}
    given = getattr(args, "speculative_config", None) or {}
    clash = sorted(k for k in values if k in given and given[k] != values[k])
    if clash:
        raise SystemExit(f"error: --speculative-config and the speculation flags disagree on {', '.join(clash)}")
    values = {**given, **values}
    if getattr(args, "no_speculation", False):
        if values:
            raise SystemExit(f"error: {NO_SPECULATION_FLAG} with speculation flags ({', '.join(sorted(values))})")
        return None
    if not values:
        return dict(DEFAULT_SPECULATION) if DEFAULT_SPECULATION else None
    if "method" not in values and "model" not in values:
        raise SystemExit("error: --num-speculative-tokens needs --speculative-model or --speculative-method")
    return values


def lora_from_args(args):
    """``generate --lora DIR`` / ``chat --lora DIR``: the adapter every request of the command runs with
    (llama-cli's flag), or None."""
    from specserve.lora.request import LoRARequest

    return LoRARequest("lora", 1, args.lora) if getattr(args, "lora", None) else None


def build_llm(args, plain: bool = False):
    """The ``LLM`` the flags describe (``plain``: the same without speculation)."""
    from specserve import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
        tokenizer=getattr(args, "tokenizer", None),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        seed=getattr(args, "engine_seed", EngineConfig.seed),   # serve's --seed (generate's is the request's)
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=None if plain else speculative_config_from_args(args),
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=getattr(args, "enforce_eager", False),
        generation_config=getattr(args, "generation_config", "auto"),
        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
        override_generation_config=getattr(args, "override_generation_config", None),
        int8_activations=(args.int8_activation_pieces if getattr(args, "int8_activation_pieces", None)
                          else args.int8_activations),
        pooling=getattr(args, "pooling", EngineConfig.pooling),
        enable_lora=bool(getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None)
                         or getattr(args, "lora", None) or getattr(args, "lora_scaled", None)),
        max_loras=getattr(args, "max_loras", EngineConfig.max_loras),
        max_lora_rank=getattr(args, "max_lora_rank", EngineConfig.max_lora_rank),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
    )
    if getattr(args, "chat_template", None):   # every chat path (generate --chat, the server, its tools) reads it
        tokenizer = llm.get_tokenizer()
        tokenizer.chat_template = load_chat_template(tokenizer, args.chat_template)
    return llm
