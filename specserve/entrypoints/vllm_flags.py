"""vLLM's ``serve`` flags that specserve accepts so vLLM's command lines run as they are.

``--enable-log-requests`` logs each request's settings (``request_streams.REQUEST_LOG``). The
others either change nothing here, with the reason in their help (what vLLM turns on or off is
always so in specserve, or does not exist in it), or allows only the value that is so here
(``--kv-cache-dtype auto``, ``--quantization gguf``): another value stops the start with
argparse's message naming the values allowed. Flags that change behaviour (``--api-key``,
``--gpu-memory-utilization``, ``--enable-auto-tool-choice``, ...) are defined with the rest.
"""
from __future__ import annotations

import argparse

# flag -> why it changes nothing here
NO_OP_SWITCHES = {
    "--disable-log-requests": "request contents are never logged",
    "--disable-log-stats": "no periodic stats are logged; /metrics has them",
    "--enable-chunked-prefill": "prefills are always chunked by --max-num-batched-tokens",
    "--disable-fastapi-docs": "the server serves no API docs pages",
}


def add_vllm_serve_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("vLLM's flags, accepted (docs/serving.md)")
    for flag, why in NO_OP_SWITCHES.items():
        group.add_argument(flag, action="store_true", help=f"accepted for vLLM's command lines: {why}")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it is queued (logger specserve.requests): its id, endpoint, "
                            "prompt length, priority and sampling settings; never its text")
    group.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                       help="accepted for vLLM's command lines: preempted requests are computed again, never "
                            "swapped")
    group.add_argument("--kv-cache-dtype", choices=["auto"], default="auto",
                       help="the KV cache's type follows the activations' (auto is the only value)")
    group.add_argument("--quantization", choices=["gguf"], default=None,
                       help="weights are quantized as their file says (GGUF blocks kept as they are)")
    group.add_argument("--tokenizer", default=None, metavar="NAME_OR_FOLDER",
                       help="accepted for vLLM's command lines (its GGUF recipe names the model's Hugging Face "
                            "tokenizer): specserve reads the tokenizer from the model, a GGUF file's own included; "
                            "a warning says so")
    group.add_argument("--uvicorn-log-level", dest="log_level",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="vLLM's name for --log-level")
