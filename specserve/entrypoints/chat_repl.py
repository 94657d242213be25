"""``specserve chat``: a conversation in the terminal with a model run in-process (as llama.cpp's
``llama-cli`` conversation mode; vLLM's ``vllm chat`` is the same over a running server).

Each line read is a user message; the answer streams as the engine verifies it (several tokens
at once where drafts are accepted), and the conversation so far goes with every turn through the
model's chat template. ``/reset`` forgets the conversation, ``/exit`` (or end of input) ends it.
With speculation, a line on stderr after each answer says what the drafts did for that turn.
A turn that no longer fits the context is refused with the reason, and the conversation stays as
it was before that message.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from specserve.entrypoints.engine_args import build_llm, lora_from_args
from specserve.entrypoints.generate_cmd import GENERATE_DEFAULTS, print_summary, sampling_params_from_args

COMMANDS = "/reset forgets the conversation, /exit ends it"


CHAT_DEFAULTS = {**GENERATE_DEFAULTS, "max_tokens": None}     # chat answers run to their end (or the context's)


def cmd_chat(args) -> int:
    """``specserve chat``: a conversation in the terminal (``chat_repl.py``)."""
    sampling_params_from_args(args, {}, CHAT_DEFAULTS)      # bad flags are refused before the model loads
    llm = build_llm(args)
    params = sampling_params_from_args(args, llm.engine.sampling_defaults, CHAT_DEFAULTS)
    spec = llm.engine.spec_config
    summarize = None if spec is None else (
        lambda stats, tokens, seconds: print_summary(spec.method, stats, tokens, seconds))
    return run_chat(args, params, llm, summarize)


def run_chat(args, params, llm, summarize: Callable | None = None, stdin=None, stdout=None, stderr=None) -> int:
    """The conversation loop; ``params``: the SamplingParams of every answer; ``summarize(stats,
    tokens, seconds)``: prints a speculating engine's line after each answer."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    history: list[dict] = []
    interactive = stdin.isatty()
    if interactive:
        print(f"[specserve chat: {llm.engine.model_name}; {COMMANDS}]", file=stderr)
    while True:
        if interactive:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            return 0
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            history.clear()
            continue
        if not text.strip():
            continue
        conversation = system + history + [{"role": "user", "content": text}]
        try:
            answer = _answer(llm, conversation, params, stdout, summarize, lora_from_args(args))
        except ValueError as e:     # the conversation no longer fits, or another refusal: this turn only
            print(f"error: {e} ({COMMANDS})", file=stderr)
            continue
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]


def _answer(llm, conversation: list[dict], params, stdout, summarize: Callable | None, lora=None) -> str:
    """Stream one answer to ``stdout`` (with the LoRA adapter ``lora``, if any); its text."""
    engine = llm.engine
    prompt = llm.apply_chat_template(conversation)
    started = time.perf_counter()
    request_id = engine.add_request(prompt, params, lora_request=lora)
    shown, text, tokens, stats = 0, "", 0, None
    try:
        while True:
            outs = [o for o in engine.step() if o.request_id == request_id]
            if not outs:
                if not engine.has_unfinished_requests():
                    break
                continue
            out = outs[-1]
            completion = out.outputs[0]
            text, tokens, stats = completion.text, len(completion.token_ids), out.spec_decode_stats
            ready = len(text) if out.finished else len(text.rstrip("\ufffd"))   # whole characters only
            if ready > shown:
                print(text[shown:ready], end="", file=stdout, flush=True)
                shown = ready
            if out.finished:
                break
    except BaseException:
        engine.abort_request(request_id)
        raise
    print(file=stdout, flush=True)
    if summarize is not None and stats is not None:
        summarize(stats, tokens, time.perf_counter() - started)
    return text
