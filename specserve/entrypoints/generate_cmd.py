"""``specserve generate``: one prompt answered (or beam-searched), with its flags.

The sampling flags (``add_sampling_args``, shared with ``specserve chat``) take the model's
generation config where left out, else ``GENERATE_DEFAULTS``; ``--compare-plain`` times plain
decoding of the same request beside the speculative one; ``--beam-width`` runs beam search and
says whether plain beam search gives the same beams.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from specserve.entrypoints.engine_args import add_model_args, build_llm, lora_from_args
from specserve.entrypoints.fill_in_middle import fim_params, fim_prompt


def structured_output_from_args(args):
    """--json-schema FILE, --json-object, --regex R, --grammar FILE or --choice S (repeated) -> a
    StructuredOutput, or None; SystemExit naming the problem (an unreadable file, two at once)."""
    from specserve import StructuredOutput

    given = {}
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                given["json_schema"] = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --json-schema {args.json_schema}: {e}") from None
    if args.grammar is not None:
        try:
            with open(args.grammar, encoding="utf-8") as f:
                given["grammar"] = f.read()
        except OSError as e:
            raise SystemExit(f"error: --grammar {args.grammar}: {e}") from None
    if args.regex is not None:
        given["regex"] = args.regex
    if args.choice:
        given["choice"] = args.choice
    if args.json_object:
        given["json_object"] = True
    if len(given) > 1:
        raise SystemExit(f"error: one of --json-schema, --json-object, --regex, --grammar, --choice at a time, got "
                         f"{', '.join('--' + k.replace('_', '-') for k in given)}")
    try:
        return StructuredOutput(**given) if given else None
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def cmd_generate(args) -> int:
    if args.beam_width is not None:
        return cmd_beam_search(args)
    if args.chat and args.suffix is not None:
        raise SystemExit("error: --suffix fills in the middle of a completion prompt; it cannot go with --chat")
    sampling_params_from_args(args, {})     # bad flags are refused before the model loads
    llm = build_llm(args)
    params = sampling_params_from_args(args, llm.engine.sampling_defaults)
    if args.compare_plain and llm.engine.spec_config is not None:
        _answer(llm, args, _warm_up(params))   # warm-up, as the plain engine gets
    started = time.perf_counter()
    out = _answer(llm, args, params)
    elapsed = time.perf_counter() - started
    stats = llm.get_spec_decode_stats()
    plain_tok_s = None
    if args.compare_plain and llm.engine.spec_config is not None:
        plain_tok_s = _plain_tok_s(args, params)
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
            if out.prompt_logprobs is not None:
                doc["prompt_logprobs"] = [None if entry is None else {str(tid): lp.logprob for tid, lp in entry.items()}
                                          for entry in out.prompt_logprobs]
            if args.stats:
                doc["spec_decode_stats"] = stats.as_dict()
            print(json.dumps(doc, ensure_ascii=False))
    else:
        for completion in out.outputs:
            if len(out.outputs) > 1:
                print(f"--- sample {completion.index}")
            print(completion.text)
        if llm.engine.spec_config is not None:
            print_summary(llm.engine.spec_config.method, stats, sum(len(c.token_ids) for c in out.outputs), elapsed,
                          plain_tok_s=plain_tok_s)
        if args.stats:
            print_stats(stats, file=sys.stderr)
        if out.prompt_logprobs is not None:
            print(prompt_summary(out), file=sys.stderr)
    return 0


# generate's own defaults for the sampling flags the model's generation config may set instead
GENERATE_DEFAULTS = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                     "repetition_penalty": 1.0}
def sampling_params_from_args(args, model_defaults: dict, own_defaults: dict = GENERATE_DEFAULTS):
    """generate's (and chat's) SamplingParams: each flag given, else the model's default (its
    generation config: ``LLMEngine.sampling_defaults``), else ``own_defaults`` (generate's: greedy,
    128 tokens)."""
    from specserve import SamplingParams

    def value(name):
        given = getattr(args, name)
        return given if given is not None else model_defaults.get(name, own_defaults[name])

    return SamplingParams(
        structured_output=structured_output_from_args(args) if hasattr(args, "json_schema") else None,
        max_tokens=value("max_tokens"),
        min_tokens=args.min_tokens,
        temperature=value("temperature"),
        top_p=value("top_p"),
        top_k=value("top_k"),
        min_p=value("min_p"),
        seed=args.seed,
        stop=args.stop,
        logprobs=getattr(args, "logprobs", None),
        prompt_logprobs=getattr(args, "prompt_logprobs", None),
        n=getattr(args, "n", 1),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=value("repetition_penalty"),
    )


def prompt_summary(out) -> str:
    """--prompt-logprobs' line: the prompt's perplexity under the model (each token after the
    first given the tokens before it)."""
    lps = [entry[tid].logprob for entry, tid in zip(out.prompt_logprobs, out.prompt_token_ids) if entry is not None]
    if not lps:
        return "[prompt] 1 token: nothing to score"
    mean = sum(lps) / len(lps)
    return f"[prompt] {len(lps)} tokens scored: perplexity {math.exp(-mean):.3f} (mean log-probability {mean:.4f})"


# generate's flags beam search has no use for (it is deterministic and ranks whole beams:
# docs/speculative_decoding.md, "Beam search"); refused where they differ from their defaults.
NOT_FOR_BEAMS = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "seed", "stop", "logprobs", "prompt_logprobs",
                 "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "json_schema", "json_object", "regex",
                 "grammar", "choice", "suffix")


def cmd_beam_search(args) -> int:
    """``generate --beam-width B``: the B best beams, best first, each with its score; with
    --compare-plain, whether plain beam search gives the same beams, and the time against it."""
    from specserve.beam_search_params import BeamSearchParams

    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    defaults = parser.parse_args([""])
    given = [f"--{name.replace('_', '-')}" for name in NOT_FOR_BEAMS if getattr(args, name) != getattr(defaults, name)]
    if given:
        raise ValueError(f"--beam-width takes none of {', '.join(given)}: beam search is deterministic and ranks "
                         f"whole beams by their cumulative log-probability")
    def beam_params(model_defaults: dict) -> BeamSearchParams:
        max_tokens = (args.max_tokens if args.max_tokens is not None
                      else model_defaults.get("max_tokens", GENERATE_DEFAULTS["max_tokens"]))
        return BeamSearchParams(beam_width=args.beam_width, max_tokens=max_tokens, length_penalty=args.length_penalty)

    beam_params({})     # bad flags are refused before the model loads
    llm = build_llm(args)
    params = beam_params(llm.engine.sampling_defaults)
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    speculative = llm.engine.spec_config is not None
    if args.compare_plain and speculative:
        _search(llm, prompt, _warm_up(params), lora_from_args(args))   # warm-up, as the plain engine gets
    out, seconds = _search(llm, prompt, params, lora_from_args(args))
    for i, beam in enumerate(out.sequences):
        generated = beam.tokens[len(beam.tokens) - len(beam.logprobs):]
        if args.json:
            print(json.dumps({"prompt": args.prompt, "index": i, "text": beam.text, "token_ids": generated,
                              "cum_logprob": beam.cum_logprob, "score": beam.score,
                              "finish_reason": beam.finish_reason}, ensure_ascii=False))
        else:
            print(f"--- beam {i}: score {beam.score:.4f} (cumulative log-probability {beam.cum_logprob:.4f})")
            print(beam.text)
    if speculative:
        d = llm.get_spec_decode_stats().as_dict()
        vs = ""
        if args.compare_plain:
            plain = build_llm(args, plain=True)
            _search(plain, prompt, _warm_up(params), lora_from_args(args))
            plain_out, plain_seconds = _search(plain, prompt, params, lora_from_args(args))
            vs = (f", {plain_seconds / max(seconds, 1e-9):.2f}x plain beam search's {plain_seconds:.2f} s; "
                  f"{_same_beams(plain_out, out)}")
        print(f"[speculation: {llm.engine.spec_config.method}] {d['num_accepted_tokens']} of "
              f"{d['num_draft_tokens']} drafted tokens accepted, {d['mean_acceptance_length']:.2f} depths a pass, "
              f"{seconds:.2f} s{vs}", file=sys.stderr)
    return 0


def _same_beams(plain, speculative) -> str:
    """How the speculative search's beams compare with plain beam search's: equal bit for bit in
    the CPU default dtype; in float32 the scores' last bits follow the rows a step verifies."""
    if [b.tokens for b in plain.sequences] != [b.tokens for b in speculative.sequences]:
        return "beams DIFFERENT from plain beam search's"
    gap = max(abs(a.cum_logprob - b.cum_logprob) for a, b in zip(plain.sequences, speculative.sequences))
    return "beams identical to plain beam search's" if gap == 0 else \
        f"plain beam search's beams, scores within {gap:.1e}"


def _search(llm, prompt, params, lora=None):
    started = time.perf_counter()
    out = llm.beam_search([prompt], params, lora_request=lora)[0]
    return out, time.perf_counter() - started


def _answer(llm, args, params):
    lora = lora_from_args(args)
    if args.chat:
        return llm.chat([{"role": "user", "content": args.prompt}], params, lora_request=lora)[0]
    if args.suffix is not None:   # fill in the middle: the prompt is the prefix
        tok = llm.get_tokenizer()
        return llm.generate(fim_prompt(tok, args.prompt, args.suffix), fim_params(tok, params), lora_request=lora)[0]
    return llm.generate(args.prompt, params, lora_request=lora)[0]


def _warm_up(params):
    """A short request like ``params`` (4 tokens; SamplingParams or BeamSearchParams): the prefill and a few decode steps, so kernels
    compiled or loaded on first use are not timed."""
    import copy

    p = copy.copy(params)
    p.max_tokens = min(4, params.max_tokens)
    return p


def _plain_tok_s(args, params) -> float:
    """--compare-plain: the same request on a plain engine of the same model (warmed up first), in tok/s."""
    plain = build_llm(args, plain=True)
    _answer(plain, args, _warm_up(params))
    started = time.perf_counter()
    out = _answer(plain, args, params)
    return sum(len(c.token_ids) for c in out.outputs) / max(time.perf_counter() - started, 1e-9)


def print_summary(method: str, stats, tokens: int, seconds: float, file=None, plain_tok_s: float | None = None) -> None:
    """One line of what speculation did (on stderr, so the answer alone goes to stdout); with
    ``plain_tok_s`` (--compare-plain) the speed against plain decoding of the same request."""
    file = sys.stderr if file is None else file
    d = stats.as_dict()
    rate = tokens / max(seconds, 1e-9)
    vs = f", {rate / plain_tok_s:.2f}x plain's {plain_tok_s:.1f} tok/s" if plain_tok_s else ""
    print(f"[speculation: {method}] {d['num_accepted_tokens']} of {d['num_draft_tokens']} drafted tokens accepted, "
          f"{d['mean_acceptance_length']:.2f} tokens per target step, {rate:.1f} tok/s{vs} "
          f"({tokens} tokens in {seconds:.2f} s, prefill included)", file=file)


def print_stats(stats, file=sys.stderr) -> None:
    d = stats.as_dict()
    print(
        f"[spec decode] drafts={d['num_drafts']} draft_tokens={d['num_draft_tokens']} "
        f"accepted={d['num_accepted_tokens']} acceptance_rate={d['acceptance_rate']:.3f} "
        f"mean_acceptance_length={d['mean_acceptance_length']:.3f} "
        f"by_position={d['acceptance_by_position']}",
        file=file,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """generate's and chat's sampling flags. Left out, they take the model's generation config
    (--generation-config), else GENERATE_DEFAULTS."""
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: the model's max_new_tokens, else 128 (generate) or the context's end (chat)")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1")
    p.add_argument("--top-k", type=int, default=None, help="default: the model's, else -1 (off)")
    p.add_argument("--min-p", type=float, default=None, help="default: the model's, else 0")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="no end of sequence, stop token or stop string before this many tokens")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]: once per token already in the output")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]: per occurrence in the output")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages prompt and output tokens (default: the model's, else 1)")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    """``specserve generate``'s arguments: the prompt, the model's, the sampling flags and its own."""
    p.add_argument("prompt")
    add_model_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="run with this PEFT LoRA adapter (a folder with adapter_config.json; turns --enable-lora on)")
    add_sampling_args(p)
    p.add_argument("--suffix", default=None, metavar="TEXT",
                     help="fill in the middle: write what goes between the prompt and TEXT (code models trained "
                          "on it, such as Qwen2.5-Coder)")
    p.add_argument("--logprobs", type=int, default=None, help="return the top-n log-probabilities per token")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                     help="score the prompt: each prompt token's log-probability and the top N (--json), and its "
                          "perplexity (a line on stderr)")
    p.add_argument("--n", type=int, default=1, help="samples of the prompt (they share its prefill)")
    p.add_argument("--json", action="store_true", help="print the output as JSON, token ids included")
    p.add_argument("--beam-width", type=int, default=None, metavar="B",
                     help="beam search: print the B best beams, best first, with their scores (with speculation: "
                          "plain beam search's beams, exactly)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                     help="beam search: a beam's score is its cumulative log-probability / length ** this")
    so = p.add_argument_group("structured output (one at a time; docs/serving.md)")
    so.add_argument("--json-schema", metavar="FILE", default=None, help="the output is JSON valid under this schema")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", metavar="R", default=None, help="the output matches this regular expression")
    so.add_argument("--grammar", metavar="FILE", default=None, help="the output follows this grammar (Lark or GBNF)")
    so.add_argument("--choice", action="append", default=None, help="the output is one of these strings (repeatable)")
    p.add_argument("--stats", action="store_true", help="print speculative-decoding metrics")
    p.add_argument("--compare-plain", action="store_true",
                     help="with speculation: also answer with plain decoding and print the speed against it")
