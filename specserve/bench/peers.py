"""Peers measured in the same run as specserve: Hugging Face transformers and llama.cpp's server.

Both answer the very prompt token ids specserve does (the chat template applied
once, by specserve's tokenizer), with the same number of new tokens, in the same
rotation of configurations.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.bench.engines import GroupResult
from specserve.bench.options import BenchOptions, BenchPrompt

DEFAULT_LLAMA_CPP_BIN = os.path.expanduser("~/.cache/specserve-peers/llama.cpp/build/bin")


SHORT_DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


def load_transformers_model(model: str | None, dtype_name: str, device: torch.device | str = "cpu"):
    """transformers' model class on the very weights specserve's loader reads, on ``device``:
    ``(model, tokenizer, dtype)``."""
    from transformers import AutoModelForCausalLM

    from specserve.model_executor.loader import load_model, resolve_dtype

    dtype = resolve_dtype(dtype_name, torch.device(device))
    loaded = load_model(model, dtype)
    hf = AutoModelForCausalLM.from_config(loaded.config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(loaded.state_dict, strict=False)
    hf.tie_weights()
    bad = [m for m in missing if not (m == "lm_head.weight" and loaded.config.tie_word_embeddings)]
    if bad or unexpected:
        raise RuntimeError(f"transformers peer: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")
    return hf.to(device).eval(), loaded.tokenizer, dtype


# transformers' prompt lookup decoding drafts this many tokens (as ngram:4)
PROMPT_LOOKUP_TOKENS = 4


def shipped_draft_for(opts: BenchOptions) -> str:
    """The shipped draft model of the default target (the assisted peer's default assistant)."""
    from specserve.drafts import shipped_draft

    return shipped_draft("draft_model", opts.model)


class TransformersPeer:
    """``generate`` on the very weights specserve loads.

    ``dtype_name``: default ``opts.transformers_dtype``; ``named_by_dtype``: call it
    ``transformers-bf16`` (etc.) rather than ``transformers``, for runs of several dtypes.
    ``assistant``: a draft model's path, passed as ``assistant_model`` (assisted generation);
    ``prompt_lookup``: ``prompt_lookup_num_tokens`` (transformers' n-gram drafting). Either one
    makes the peer run a group's prompts one at a time: transformers drafts for batch 1 only.
    It runs on the device specserve runs on (``opts.device``; default: cuda when available).
    """

    def __init__(self, opts: BenchOptions, dtype_name: str | None = None, named_by_dtype: bool = False,
                 assistant: str | None = None, prompt_lookup: int | None = None):
        from specserve.engine.start_up import resolve_device

        self.device = resolve_device(opts.device)
        self.model, self.tok, dtype = load_transformers_model(opts.model, dtype_name or opts.transformers_dtype,
                                                              self.device)
        self.name = "transformers-" + SHORT_DTYPES.get(dtype, str(dtype).removeprefix("torch.")) \
            if named_by_dtype else "transformers"
        self.description = f"Hugging Face transformers generate, {dtype}, same weights"
        self.drafting: dict = {}
        if assistant is not None:
            self.drafting["assistant_model"] = load_transformers_model(assistant, dtype_name or opts.transformers_dtype,
                                                                       self.device)[0]
            self.name, self.description = "transformers-assisted", self.description + f", assistant_model {assistant}"
        elif prompt_lookup is not None:
            self.drafting["prompt_lookup_num_tokens"] = prompt_lookup
            self.name = f"transformers-ngram:{prompt_lookup}"
            self.description += f", prompt lookup of {prompt_lookup} tokens"
        if self.drafting:
            self.description += ", one prompt at a time"
        pad = self.tok.pad_token_id
        self.pad_id = pad if pad is not None else self.tok.eos_token_id

    def tokenizer(self):
        return self.tok

    @torch.inference_mode()
    def run(self, prompts: list[BenchPrompt], max_tokens: int, temperature: float, seeds: list[int],
            ignore_eos: bool) -> GroupResult:
        if self.drafting and len(prompts) > 1:   # transformers drafts for one sequence at a time
            rows = [self.run([p], max_tokens, temperature, [s], ignore_eos).token_ids[0] for p, s in zip(prompts, seeds)]
            return GroupResult(rows, [None] * len(prompts))
        width = max(len(p.token_ids) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):   # left padding
            n = len(p.token_ids)
            ids[i, width - n:] = torch.tensor(p.token_ids)
            mask[i, width - n:] = 1
        kwargs = dict(max_new_tokens=max_tokens, pad_token_id=self.pad_id, **self.drafting)
        if ignore_eos:
            kwargs.update(min_new_tokens=max_tokens)
        if temperature == 0:
            kwargs.update(do_sample=False)
        else:
            torch.manual_seed(seeds[0])
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        rows = [row[width:].tolist() for row in out]
        if not ignore_eos:   # a row that ended early is padded: keep up to its end-of-sequence token
            eos = self.tok.eos_token_id
            rows = [r[: r.index(eos) + 1] if eos in r else r for r in rows]
        return GroupResult(rows, [None] * len(prompts))

    def close(self) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_server_exe(bin_dir: str | None) -> str:
    """``llama-server`` in ``bin_dir`` (default ``DEFAULT_LLAMA_CPP_BIN``); a ValueError saying how to build it."""
    bin_dir = os.path.expanduser(bin_dir or DEFAULT_LLAMA_CPP_BIN)
    exe = os.path.join(bin_dir, "llama-server")
    if not os.access(exe, os.X_OK):
        raise ValueError(f"no llama-server in {bin_dir}: build it with ../shared/peers/build-llamacpp.sh "
                         "and pass --llama-cpp-bin DIR/build/bin")
    return exe


def start_llama_server(exe: str, model_path: str, threads: int, ctx_size: int, slots: int = 1,
                       log=subprocess.DEVNULL, timeout_s: float = 600,
                       extra_args: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """Start ``llama-server`` on a free local port and wait until ``/health`` answers: ``(process, base URL)``.

    ``extra_args`` go on its command line as they are (for example ``-md DRAFT.gguf``)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([exe, "-m", model_path, "-t", str(threads), "-c", str(ctx_size), "-np", str(slots),
                             "--port", str(port), "--host", "127.0.0.1", *extra_args], stdout=log, stderr=log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.5)
    stop_process(proc)
    raise RuntimeError(f"llama-server did not become healthy in {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gguf_path(model: str | None) -> str:
    from specserve.model_executor.loader import default_model_path

    if model is None:
        return default_model_path()
    if model.endswith(".gguf") and os.path.isfile(model):
        return model
    try:
        from specserve import catalog

        entry = catalog.ENTRIES.get(model)
        path = catalog.verified_path(entry) if entry is not None else None
        if path:
            return path
    except Exception:   # the catalog is a convenience here; the error below says what is needed
        pass
    raise ValueError(f"--peer llama.cpp needs a .gguf model (--model FILE.gguf or a catalog name), not {model!r}")


class LlamaServer:
    """A running ``llama-server`` on a GGUF file, for the peers and suites that measure it from outside.

    Started on a free local port with ``slots`` slots (its log discarded), it answers ``completion``
    (prompt token ids to ``/completion``, no prompt cache, the generated token ids returned) and
    ``map`` (one request per slot at a time, concurrently); ``close`` stops it.
    """

    def __init__(self, model_path: str, threads: int, ctx_size: int, slots: int = 1, bin_dir: str | None = None,
                 extra_args: list[str] = ()):
        exe = llama_server_exe(bin_dir)
        self.log = open(os.devnull, "w")
        self.proc = None
        try:
            self.proc, self.base = start_llama_server(exe, model_path, threads, ctx_size, slots, log=self.log,
                                                      extra_args=extra_args)
        except BaseException:
            self.log.close()
            raise
        self.pool = ThreadPoolExecutor(slots)

    def completion(self, ids: list[int], **body) -> tuple[str, list[int]]:
        """(text, generated token ids) for prompt token ids; ``body``: llama-server's /completion fields."""
        out = post_json(self.base + "/completion", {"prompt": ids, "cache_prompt": False, "return_tokens": True,
                                                    "stream": False, **body})
        tokens = out.get("tokens")
        if not tokens:   # older servers: only a count
            tokens = [-1] * int(out.get("tokens_predicted", 0))
        return out.get("content", ""), list(tokens)

    def map(self, fn, items) -> list:
        """``fn`` over ``items`` on the server's slots, concurrently; results in order."""
        return list(self.pool.map(fn, items))

    def close(self) -> None:
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=False)
        if self.proc is not None:
            stop_process(self.proc)
        self.log.close()


class LlamaCppPeer:
    """llama.cpp's ``llama-server`` on the same GGUF file, plain decoding, measured from outside.

    Started once with ``--threads`` threads and one slot per request of the largest
    batch; a group's requests are sent concurrently (prompt token ids to
    ``/completion``, no prompt cache), and the group's wall time is measured here.
    """

    def __init__(self, opts: BenchOptions):
        self.name = "llama.cpp"
        self.model_path = gguf_path(opts.model)
        slots = max(opts.batch_sizes)
        threads = opts.threads or torch.get_num_threads()
        self.description = f"llama.cpp llama-server, {os.path.basename(self.model_path)}, {threads} threads"
        self.server = LlamaServer(self.model_path, threads, opts.max_model_len * slots, slots, opts.llama_cpp_bin)

    def tokenizer(self):
        raise RuntimeError("the llama.cpp peer uses specserve's tokenizer")

    def _one(self, ids: list[int], max_tokens: int, temperature: float, seed: int, ignore_eos: bool) -> list[int]:
        return self.server.completion(ids, n_predict=max_tokens, temperature=temperature, seed=seed, top_k=0,
                                      top_p=1.0, min_p=0.0, repeat_penalty=1.0, ignore_eos=ignore_eos)[1]

    def run(self, prompts: list[BenchPrompt], max_tokens: int, temperature: float, seeds: list[int],
            ignore_eos: bool) -> GroupResult:
        tokens = self.server.map(lambda ps: self._one(ps[0].token_ids, max_tokens, temperature, ps[1], ignore_eos),
                                 list(zip(prompts, seeds)))
        return GroupResult(tokens, [None] * len(prompts))

    def close(self) -> None:
        self.server.close()
