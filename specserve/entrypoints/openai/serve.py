"""``specserve serve``: build the engine from the command line's arguments, then serve until interrupted."""
from __future__ import annotations

import logging
import os

import uvicorn

from specserve.entrypoints.engine_args import build_llm
from specserve.entrypoints.openai.api_server import CORSOptions, build_app
from specserve.entrypoints.openai.connection import tls_options, uvicorn_config
from specserve.entrypoints.openai.limits import OPTIONS as LIMIT_OPTIONS, ServerLimits
from specserve.entrypoints.openai.request_streams import REQUEST_LOG

logger = logging.getLogger(__name__)


def run_server(args) -> int:
    """``specserve serve``: build the engine, then serve until interrupted."""
    api_key = args.api_key or os.environ.get("SPECSERVE_API_KEY") or None
    limits = ServerLimits.from_env(**{o.field: getattr(args, o.field, None) for o in LIMIT_OPTIONS})
    cors = CORSOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
    tls = tls_options(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    if args.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    # vLLM's --enable-log-requests: one line a queued request (request_streams.REQUEST_LOG)
    REQUEST_LOG.setLevel(logging.INFO if getattr(args, "enable_log_requests", False) else logging.WARNING)
    llm = build_llm(args)
    engine = llm.engine
    names = list(args.served_model_name or []) or [engine.model_name]
    if args.model and args.model not in names:
        names.append(args.model)
    app = build_app(llm, names, api_key=api_key, limits=limits, cors=cors,
                    max_stored_responses=args.max_stored_responses, reasoning_parser=args.reasoning_parser,
                    lora_modules=args.lora_modules, llama_loras=llama_loras_from_args(args))
    async_engine = app.state.async_engine
    async_engine.start()
    spec = engine.spec_config
    logger.info(
        "serving %s on %s://%s:%d (speculation: %s)", names[0], "https" if tls else "http", args.host, args.port,
        f"{spec.method}, k={spec.num_speculative_tokens}" if spec else "off",
    )
    logger.info(capacity_line(engine))
    try:
        uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level, **tls)).run()
    finally:
        async_engine.shutdown(timeout=5)
    return 0


def llama_loras_from_args(args) -> list[tuple[str, float]]:
    """llama-server's --lora FILE (scale 1) and --lora-scaled FILE SCALE, in order; scale 0 with
    --lora-init-without-apply."""
    loras = [(path, 1.0) for path in args.lora or []]
    for path, scale in args.lora_scaled or []:
        try:
            loras.append((path, float(scale)))
        except ValueError:
            raise ValueError(f"--lora-scaled {path} {scale}: the scale must be a number") from None
    return [(path, 0.0) for path, _ in loras] if args.lora_init_without_apply else loras


def capacity_line(engine) -> str:
    """How much the KV cache holds, in the terms that size a deployment (vLLM logs the same: its
    "maximum concurrency" at the model's length)."""
    kv, seqs = engine.kv_cache, engine.config.max_num_seqs
    tokens = kv.num_blocks * kv.block_size
    at_full_length = tokens / engine.max_model_len
    return (f"KV cache: {kv.num_blocks} blocks of {kv.block_size} tokens = {tokens:,} tokens; "
            f"{at_full_length:.1f} requests of max_model_len {engine.max_model_len} at once "
            f"(--max-num-seqs {seqs}; more wait, or are preempted and resumed: --kv-cache-memory sizes it)")
