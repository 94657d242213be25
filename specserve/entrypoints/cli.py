"""The ``specserve`` command line: ``specserve generate | serve | train-draft | bench | models``."""
from __future__ import annotations

import argparse
import json
import sys

from specserve.bench.cli import add_bench_parser
from specserve.training.cli import add_train_draft_parser


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that builds an engine."""
    p.add_argument("--model", default=None, help="a .gguf file, a Hugging Face folder, a catalog name (`specserve models`) or a cached hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto (float16 weights with float32 activations on x86 CPUs, else float32; bfloat16 on GPU), bfloat16, float16 or float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes of KV cache")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--speculative-model", default=None, help="draft model (anything --model accepts)")
    p.add_argument("--speculative-method", default=None, choices=["draft_model", "ngram", "eagle", "suffix"])
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="k, draft tokens per step")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest suffix to match")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest suffix to match")
    p.add_argument("--prompt-lookup-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="ngram: propose min(k, match length) tokens (default) rather than always k")
    p.add_argument("--prompt-lookup-tree", action=argparse.BooleanOptionalAction, default=None,
                   help="ngram: propose several earlier continuations as a tree of at most k tokens")
    p.add_argument("--suffix-max-depth", type=int, default=None, help="suffix: the draft tree's depth at most")
    p.add_argument("--suffix-min-token-prob", type=float, default=None,
                   help="suffix: smallest (count-based) probability of a draft token")
    p.add_argument("--suffix-max-cached-requests", type=int, default=None,
                   help="suffix: recent requests the global suffix trie keeps (0: only each request's own)")
    p.add_argument("--suffix-max-spec-factor", type=float, default=None,
                   help="suffix: at most this many draft tokens per matched token (default 1)")
    p.add_argument("--speculative-dynamic-k", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each request's draft length every step from measured costs and acceptance "
                        "(--num-speculative-tokens is the maximum)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="skip drafting in steps with at least this many decoding requests")
    p.add_argument("--draft-tensor-parallel-size", type=int, default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft_model: the draft proposes only the first N token ids (a cheaper LM head)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of earlier requests' identical prefixes (default: on; off with EAGLE)")
    p.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=False,
                   help="CPU, GGUF blocks: multiply with activations rounded to 8 bits (AVX-512 VNNI; faster, "
                        "llama.cpp's numbers rather than float32 activations)")
    p.add_argument("--draft-int8-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="draft_model: the same for the draft (default: on; the draft only guesses, output is unchanged)")


def speculative_config_from_args(args) -> dict | None:
    values = {
        "method": args.speculative_method,
        "model": args.speculative_model,
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_adaptive": args.prompt_lookup_adaptive,
        "prompt_lookup_tree": args.prompt_lookup_tree,
        "suffix_max_depth": getattr(args, "suffix_max_depth", None),
        "suffix_min_token_prob": getattr(args, "suffix_min_token_prob", None),
        "suffix_max_cached_requests": getattr(args, "suffix_max_cached_requests", None),
        "suffix_max_spec_factor": getattr(args, "suffix_max_spec_factor", None),
        "draft_tensor_parallel_size": args.draft_tensor_parallel_size,
        "draft_vocab_size": getattr(args, "draft_vocab_size", None),
        "draft_int8_activations": getattr(args, "draft_int8_activations", None),
        "disable_by_batch_size": args.speculative_disable_by_batch_size,
        "dynamic_k": getattr(args, "speculative_dynamic_k", None),
    }
    values = {k: v for k, v in values.items() if v is not None}
    if not values:
        return None
    if "method" not in values and "model" not in values:
        raise SystemExit("error: --num-speculative-tokens needs --speculative-model or --speculative-method")
    return values


def build_llm(args):
    from specserve import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=speculative_config_from_args(args),
        enable_prefix_caching=args.enable_prefix_caching,
        int8_activations=args.int8_activations,
    )


def cmd_generate(args) -> int:
    from specserve import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        logprobs=args.logprobs,
        n=args.n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    llm = build_llm(args)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    stats = llm.get_spec_decode_stats()
    if args.json:
        for completion in out.outputs:   # one JSON line per sample (--n)
            doc = {
                "prompt": args.prompt,
                "prompt_token_ids": out.prompt_token_ids,
                "index": completion.index,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
            }
            if completion.logprobs is not None:
                doc["logprobs"] = [
                    {str(tid): lp.logprob for tid, lp in entry.items()} for entry in completion.logprobs
                ]
            if args.stats:
                doc["spec_decode_stats"] = stats.as_dict()
            print(json.dumps(doc, ensure_ascii=False))
    else:
        for completion in out.outputs:
            if len(out.outputs) > 1:
                print(f"--- sample {completion.index}")
            print(completion.text)
        if args.stats:
            print_stats(stats, file=sys.stderr)
    return 0


def print_stats(stats, file=sys.stderr) -> None:
    d = stats.as_dict()
    print(
        f"[spec decode] drafts={d['num_drafts']} draft_tokens={d['num_draft_tokens']} "
        f"accepted={d['num_accepted_tokens']} acceptance_rate={d['acceptance_rate']:.3f} "
        f"mean_acceptance_length={d['mean_acceptance_length']:.3f} "
        f"by_position={d['acceptance_by_position']}",
        file=file,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference with lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    add_model_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--logprobs", type=int, default=None, help="return the top-n log-probabilities per token")
    gen.add_argument("--n", type=int, default=1, help="samples of the prompt (they share its prefill)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]: once per token already in the output")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]: per occurrence in the output")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages prompt and output tokens")
    gen.add_argument("--json", action="store_true", help="print the output as JSON, token ids included")
    gen.add_argument("--stats", action="store_true", help="print speculative-decoding metrics")
    gen.set_defaults(func=cmd_generate)

    add_train_draft_parser(sub)
    add_bench_parser(sub)

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECSERVE_API_KEY)")
    serve.add_argument("--served-model-name", action="append", default=None,
                       help="a name clients use in 'model' (repeatable; default: the model's own name)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_server_limit_args(serve)
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="list the catalog: models PyPI packages ship, usable by name")
    models.add_argument("--json", action="store_true", help="print the catalog as JSON")
    models.set_defaults(func=cmd_models)
    return parser


def add_server_limit_args(p: argparse.ArgumentParser) -> None:
    """One flag per ``ServerLimits`` field; unset flags leave the field to its env variable or default."""
    from specserve.entrypoints.openai.limits import OPTIONS, ServerLimits

    group = p.add_argument_group("serving limits (docs/serving.md)")
    for o in OPTIONS:
        group.add_argument(o.flag, dest=o.field, type=_arg_type(o.parse), default=None, metavar="N",
                           help=f"{o.help}; default ${o.env}, else {getattr(ServerLimits, o.field)}")


def _arg_type(parse):
    """``parse`` with its ValueError turned into argparse's own error message."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def cmd_models(args) -> int:
    from specserve import catalog

    rows = []
    for e in catalog.ENTRIES.values():
        path, missing = catalog.verified_path(e), catalog.missing_packages(e)
        if path:
            installed = f"yes ({path})"
        elif not missing:
            installed = "packages installed (verified" + (", assembled" if len(e.parts) > 1 else "") + " on first use)"
        else:
            installed = f"no ({len(missing)} of {len(e.parts)} packages missing)"
        rows.append({"name": e.name, "display_name": e.display_name, "size": e.size, "architecture": e.architecture,
                     "quantization": e.quantization, "vocab_size": e.vocab_size, "drafts": list(e.drafts),
                     "path": path, "missing_packages": missing, "installed": installed,
                     "install": e.install_command, "note": e.note})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['name']}  ({r['display_name']})")
        print(f"  size          {r['size'] / 2**30:.2f} GiB ({r['size']:,} bytes), GGUF {r['quantization']}")
        print(f"  architecture  {r['architecture']}, vocabulary {r['vocab_size']:,}")
        print(f"  drafts        {', '.join(r['drafts']) or '-'}")
        print(f"  installed     {r['installed']}")
        print(f"  install with  {r['install']}")
        if r["note"]:
            print(f"  note          {r['note']}")
        print()
    return 0


def cmd_serve(args) -> int:
    import logging

    from specserve.entrypoints.openai.api_server import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_server(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
