"""The client side of the serve-load suite: concurrent streaming requests against an OpenAI-compatible
server, their TTFT / TPOT percentiles and throughput, and ``specserve serve`` in a subprocess.

TTFT is measured to the first streamed text; TPOT per request is (last chunk - first text) /
(output tokens - 1); throughput is all output tokens over the wall time of the whole batch. The
speculation counters come from the server's ``/metrics``. httpx is imported here, so only a run
of the suite needs it (it is in the ``test`` extra).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Result:
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    latency: float = 0.0
    error: str | None = None


@dataclass
class Report:
    label: str
    results: list[Result]
    wall: float
    spec: dict = field(default_factory=dict)

    def summary(self) -> dict:
        ok = [r for r in self.results if r.ok]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        tpot = [r.tpot for r in ok if r.tpot is not None]
        tokens = sum(r.output_tokens for r in ok)
        d = {
            "label": self.label,
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
            "output_tokens": tokens,
            "wall_s": round(self.wall, 2),
            "output_tok_per_s": round(tokens / self.wall, 2) if self.wall > 0 else 0.0,
        }
        for name, xs in (("ttft", ttft), ("tpot", tpot)):
            for q in (50, 90, 99):
                d[f"{name}_p{q}_ms"] = round(1000 * percentile(xs, q), 1)
        d.update(self.spec)
        return d


async def one_request(http: httpx.AsyncClient, url: str, endpoint: str, model: str, prompt: str, args,
                      fields: dict | None = None) -> Result:
    """``fields``: more of the request body (they may replace ``model``)."""
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **(fields or {})}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with http.stream("POST", url + path, json=body) as response:
            if response.status_code != 200:
                return Result(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"]))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("text") if endpoint != "chat" else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        first = first if first is not None else now
                        last = now
    except httpx.HTTPError as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    ttft = first - start if first is not None else None
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return Result(True, tokens, ttft, tpot, end - start)


def scrape_spec(url: str) -> dict:
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        if line.startswith("specserve_spec_decode_") and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in values:
                continue
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def run_load(url: str, model: str, prompts: list[str], args, request_fields=None) -> tuple[list[Result], float]:
    """``request_fields(i)``: more body fields for request i (None: none)."""
    limit = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limit, headers=_auth(args)) as http:
        async def bounded(i, p):
            async with sem:
                return await one_request(http, url, args.endpoint, model, p, args,
                                         request_fields(i) if request_fields else None)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts)))
        return list(results), time.perf_counter() - start


def measure(label: str, url: str, prompts: list[str], args, request_fields=None) -> Report:
    """``request_fields(i)``: more body fields for request i (a LoRA adapter, by name or llama-server's list)."""
    model = httpx.get(url + "/v1/models", timeout=30, headers=_auth(args)).json()["data"][0]["id"]
    # Warm-up: short requests so the first measured prefill pays no one-off costs (every adapter loaded).
    warm = min(len(prompts), getattr(args, "loras", 1) or 1)
    asyncio.run(run_load(url, model, prompts[:warm], argparse.Namespace(**{**vars(args), "max_tokens": 4,
                                                                              "concurrency": 1}), request_fields))
    before = scrape_spec(url)
    results, wall = asyncio.run(run_load(url, model, prompts, args, request_fields))
    after = scrape_spec(url)
    spec = {}
    drafted = after.get("specserve_spec_decode_num_draft_tokens_total", 0) - before.get("specserve_spec_decode_num_draft_tokens_total", 0)
    accepted = after.get("specserve_spec_decode_num_accepted_tokens_total", 0) - before.get("specserve_spec_decode_num_accepted_tokens_total", 0)
    steps = after.get("specserve_spec_decode_num_steps_total", 0) - before.get("specserve_spec_decode_num_steps_total", 0)
    emitted = after.get("specserve_spec_decode_num_emitted_tokens_total", 0) - before.get("specserve_spec_decode_num_emitted_tokens_total", 0)
    if steps:
        spec["acceptance_rate"] = round(accepted / drafted, 3) if drafted else 0.0
        spec["mean_acceptance_length"] = round(emitted / steps, 3)
    for r in results:
        if not r.ok:
            print(f"[{label}] request failed: {r.error}", file=sys.stderr)
    return Report(label, results, wall, spec)


def _auth(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``specserve serve`` in a subprocess on a free loopback port."""

    def __init__(self, extra: list[str], args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specserve.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", "--dtype", args.dtype]
        if args.model:
            cmd += ["--model", args.model]
        if args.max_model_len:
            cmd += ["--max-model-len", str(args.max_model_len)]
        cmd += extra
        self.cmd = cmd
        self.log = open(os.devnull, "w") if not args.server_log else open(args.server_log, "a")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def spec_args(args) -> list[str]:
    extra = []
    if args.speculative_method:
        extra += ["--speculative-method", args.speculative_method]
    if args.speculative_model:
        extra += ["--speculative-model", args.speculative_model]
    if extra and args.num_speculative_tokens:
        extra += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    return extra


