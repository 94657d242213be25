"""The ``specserve`` command line: ``specserve generate | chat | serve | train-draft | bench | models``
(generate's own code in ``generate_cmd.py``, chat's in ``chat_repl.py``, serve's in ``openai/serve.py``)."""
from __future__ import annotations

import argparse
import json
import sys

from specserve.bench.command import add_bench_parser
from specserve.config import EngineConfig
from specserve.entrypoints.chat_repl import cmd_chat
from specserve.entrypoints.openai.responses_store import DEFAULT_MAX_STORED_RESPONSES
from specserve.entrypoints.engine_args import (  # speculative_config_from_args: still importable from here
    add_model_args,
    json_string_list,
    lora_module,
    speculative_config_from_args,  # noqa: F401
)
from specserve.entrypoints.generate_cmd import add_generate_args, add_sampling_args, cmd_generate
from specserve.entrypoints.vllm_flags import add_vllm_serve_flags
from specserve.training.cli import add_train_draft_parser


# vLLM's --tool-call-parser names for the formats specserve reads (openai/tool_calls.py)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json", "mistral")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference with lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)

    add_train_draft_parser(sub)
    add_bench_parser(sub)

    chat = sub.add_parser("chat", help="a conversation in the terminal with the model, run in-process")
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system-prompt", default=None, help="the conversation's system message")
    chat.add_argument("--lora", default=None, metavar="DIR",
                      help="answer with this PEFT LoRA adapter (a folder with adapter_config.json)")
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECSERVE_API_KEY)")
    serve.add_argument("--served-model-name", action="append", default=None,
                       help="a name clients use in 'model' (repeatable; default: the model's own name)")
    serve.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) requests name in 'model': NAME=PATH or vLLM's JSON "
                            "'{\"name\": ..., \"path\": ...}' (turns --enable-lora on)")
    serve.add_argument("--lora", action="append", default=None, metavar="FILE",
                       help="llama-server's: a LoRA adapter (llama.cpp .gguf or PEFT folder) applied at scale 1 to "
                            "requests that name no adapter (repeatable; numbered from 0 for GET/POST /lora-adapters "
                            "and a request's 'lora' list)")
    serve.add_argument("--lora-scaled", action="append", nargs=2, default=None, metavar=("FILE", "SCALE"),
                       help="llama-server's: --lora at another scale (repeatable)")
    serve.add_argument("--lora-init-without-apply", action="store_true",
                       help="llama-server's: load the --lora adapters at scale 0 (requests or POST /lora-adapters "
                            "turn them on)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM's command lines: tool_choice 'auto' is always on")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="accepted for vLLM's command lines: every one of these formats is read whatever is named "
                            "(<tool_call> blocks; a whole answer that is a JSON call, after <|python_tag|> or "
                            "[TOOL_CALLS] too)")
    serve.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None,
                       help="a thinking model's <think> reasoning returned apart from the answer (reasoning_content): "
                            "deepseek_r1 when the chat template opens <think> in the prompt, qwen3 when the answer does")
    serve.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES, metavar="N",
                       help="the Responses API: responses kept in memory for previous_response_id and GET (the "
                            "least recently used dropped first; 0: none)")
    serve.add_argument("--scheduling-policy", choices=EngineConfig.SCHEDULING_POLICIES, default="fcfs",
                       help="fcfs (first come, first served) or priority: requests' 'priority' field (lower first) "
                            "orders the queue and chooses whom a full KV cache preempts")
    serve.add_argument("--allowed-origins", type=json_string_list, default=[], metavar="JSON",
                       help="web origins whose pages may call the server, as vLLM's: '[\"http://localhost:3000\"]', "
                            "'[\"*\"]' for any (default: none)")
    serve.add_argument("--allowed-methods", type=json_string_list, default=["*"], metavar="JSON",
                       help="with --allowed-origins: the HTTP methods allowed (default: all)")
    serve.add_argument("--allowed-headers", type=json_string_list, default=["*"], metavar="JSON",
                       help="with --allowed-origins: the request headers allowed (default: all)")
    serve.add_argument("--allow-credentials", action="store_true",
                       help="with --allowed-origins (named, not '*'): allow cookies and HTTP authentication")
    serve.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM), as vLLM's flag")
    serve.add_argument("--ssl-certfile", default=None, help="... and this certificate (PEM)")
    serve.add_argument("--ssl-ca-certs", default=None,
                       help="with HTTPS: the authorities whose client certificates --ssl-cert-reqs asks for")
    serve.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                       help="with HTTPS: client certificates 0 not asked for, 1 optional, 2 required (mutual TLS)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--seed", dest="engine_seed", type=int, default=EngineConfig.seed,
                       help="the engine's random seed, for requests without a seed of their own")
    add_server_limit_args(serve)
    add_vllm_serve_flags(serve)
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

    from specserve.entrypoints.openai.serve import run_server

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
