"""An asynchronous driver for ``LLMEngine``: one engine thread, many async streams.

``LLMEngine`` is not thread-safe, so everything that touches it (add, abort,
step) runs on ONE background thread, fed by a command queue. Requests that
arrive while a step runs join the batch at the next step (continuous batching).
Each request gets an ``asyncio.Queue`` on the event loop that asked for it; the
engine thread hands it every ``RequestOutput`` with ``loop.call_soon_threadsafe``.

    async_engine = AsyncLLMEngine(llm.engine)
    async for out in async_engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.outputs[0].text)          # cumulative text so far

Failures are isolated. A request that fails on its own (its sampling,
its detokenization: the engine finishes it with finish_reason "error") raises
``RequestFailedError`` in its ``generate``; the others carry on. A failed target
forward (``StepFailedError``) fails the requests of that step with
``EngineStepError`` and aborts them, so their KV blocks return to the pool;
requests that were not in that step carry on. Any other failure of a step (the
scheduler's) fails every request in flight. Only if the engine cannot even be
cleaned up does it become dead (``EngineDeadError``).

Prompts are tokenized on two tokenizer threads (``prepare_prompt``; chat
templates too, through ``run_off_thread``), never on the engine thread, so a
huge prompt does not stall the batch, and one slow prompt does not queue every
other. A fast tokenizer's encode and decode only read it (no truncation or
padding is ever set), so threads may share it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from specserve.beam_search_params import BeamSearchParams
from specserve.engine.embedding import EmbeddingNoRoomError
from specserve.engine.llm_engine import LLMEngine, StepFailedError
from specserve.core.request import RequestStatus
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """An engine step failed while this request was in flight."""


class RequestFailedError(RuntimeError):
    """This request failed on its own (the engine finished it with finish_reason "error")."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class _Aborted:
    """Sentinel put on a stream when its request was aborted."""


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def put(self, item) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass


# One driver per LLMEngine: two engine threads stepping one engine would corrupt it.
_DRIVERS: "weakref.WeakKeyDictionary[LLMEngine, AsyncLLMEngine]" = weakref.WeakKeyDictionary()
_DRIVERS_LOCK = threading.Lock()


def running_driver(engine: LLMEngine) -> "AsyncLLMEngine | None":
    """The AsyncLLMEngine whose thread is stepping ``engine`` now, if any."""
    with _DRIVERS_LOCK:
        driver = _DRIVERS.get(engine)
    return driver if driver is not None and driver.is_running else None


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        with _DRIVERS_LOCK:
            other = _DRIVERS.get(engine)
            if other is not None and other.is_running:
                raise ValueError("this LLMEngine already has a running AsyncLLMEngine; use AsyncLLMEngine.from_engine")
            _DRIVERS[engine] = self
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}      # touched on the engine thread only
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # Tokenization and chat templating, off the engine thread and off the event loop.
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="specserve-tokenize")
        self._stopped = False
        self.dead_error: BaseException | None = None
        self.num_steps = 0

    @classmethod
    def from_engine(cls, engine_or_llm) -> "AsyncLLMEngine":
        """The running driver of an ``LLMEngine`` (or ``LLM``), created on first use."""
        if isinstance(engine_or_llm, AsyncLLMEngine):
            return engine_or_llm
        engine = getattr(engine_or_llm, "engine", engine_or_llm)
        if not isinstance(engine, LLMEngine):
            raise TypeError(f"expected an LLM, LLMEngine or AsyncLLMEngine, got {type(engine_or_llm).__name__}")
        with _DRIVERS_LOCK:
            driver = _DRIVERS.get(engine)
        if driver is not None and driver.is_running:
            return driver
        return cls(engine)

    # ---------------------------------------------------------------- lifecycle
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def start(self) -> None:
        with self._start_lock:
            if self._stopped:
                raise EngineDeadError("the engine loop was shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests in flight are aborted."""
        self._stopped = True
        self._commands.put(("stop",))
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> "_Stream":
        """Tokenize (on the tokenizer thread), then queue the request on the engine
        thread; raises ValueError for bad input. ``BeamSearchParams``: a beam search, whose
        one output comes when it is done. ``priority``, ``lora_request``: ``LLMEngine.add_request``'s."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error!r}")
        if self._stopped:
            raise EngineDeadError("the engine loop was shut down")
        self.start()
        loop = asyncio.get_running_loop()
        prepared = await self.run_off_thread(self.engine.prepare_prompt, prompt, params)
        request_id = request_id if request_id is not None else self.new_request_id()
        stream = _Stream(request_id, loop)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", prompt, params, request_id, stream, done, prepared, priority, lora_request))
        await asyncio.wrap_future(done)
        return stream

    async def run_on_engine(self, fn, *args):
        """``fn(*args)`` on the engine thread between two steps (what changes the engine's state, such as
        loading a LoRA adapter); its result or exception comes back here."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error!r}")
        self.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, args, done))
        return await asyncio.wrap_future(done)

    async def embed(self, prompt: str | list[int], pooling: str | None = None, lora_request=None,
                    wait_s: float = 60.0, normalize: bool = True):
        """``LLMEngine.embed`` on the engine thread, the prompt tokenized on the tokenizer thread first;
        while running requests hold the KV blocks it needs it tries again after the next steps, for
        up to ``wait_s`` (then ``EmbeddingNoRoomError``)."""
        prepared = await self.run_off_thread(self.engine.prepare_prompt, prompt)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self.run_on_engine(
                    functools.partial(self.engine.embed, prompt, pooling, normalize, lora_request=lora_request,
                                      prepared=prepared))
            except EmbeddingNoRoomError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)

    async def run_off_thread(self, fn, *args):
        """``fn(*args)`` on the tokenizer thread (tokenizing, chat templates): neither the
        engine thread nor the event loop waits for it."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)
        except RuntimeError as e:  # the pool was shut down
            if self._stopped:
                raise EngineDeadError("the engine loop was shut down") from None
            raise e

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, non-blocking); its blocks are freed before the next step."""
        if self._thread is not None:
            self._commands.put(("abort", request_id))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes.

        Leaving the loop early (break, cancellation, a client disconnect) aborts
        the request. Raises ValueError (bad input), EngineStepError, EngineDeadError.
        """
        stream = await self.add_request(prompt, params, request_id, priority, lora_request)
        async for out in self.iterate(stream):
            yield out

    async def iterate(self, stream: "_Stream") -> AsyncIterator[RequestOutput]:
        """Yield a stream's outputs (the newest of those waiting); abort when left early."""
        try:
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty():  # outputs are cumulative: skip to the newest
                    nxt = stream.queue.get_nowait()
                    if isinstance(item, RequestOutput) and item.finished:
                        break
                    item = nxt
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item is _Aborted:
                    stream.finished = True
                    return
                if item.finished:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    # ------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not self._drain_commands(block=not busy):
                    break
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except StepFailedError as e:  # the forward: only that step's requests
                    logger.error("%s", e, exc_info=e.cause)
                    self._fail_requests(e.request_ids, EngineStepError(f"engine step failed: {type(e.cause).__name__}: {e.cause}"))
                    continue
                except Exception as e:  # noqa: BLE001 - delivered to the waiting requests
                    logger.exception("engine step failed")
                    self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
                    continue
                self.num_steps += 1
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if any(c.finish_reason == "error" for c in out.outputs):
                        error = engine.take_request_error(out.request_id)
                        del self._streams[out.request_id]
                        stream.put(RequestFailedError(f"request failed: {type(error).__name__}: {error}"))
                        continue
                    # The engine keeps appending to its logprob lists: hand over copies.
                    out.outputs = [c if c.logprobs is None else replace(c, logprobs=list(c.logprobs))
                                   for c in out.outputs]
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.request_id]
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine loop died")
            self.dead_error = e
        finally:
            self._stopped = True
            error = self.dead_error or EngineDeadError("the engine loop was shut down")
            for stream in self._streams.values():
                stream.put(error if isinstance(error, Exception) else EngineDeadError(repr(error)))
            self._streams.clear()
            self._fail_pending_commands(error)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        first = True
        while True:
            try:
                cmd = self._commands.get(block=block and first)
            except queue.Empty:
                return True
            first = False
            kind = cmd[0]
            if kind == "stop":
                for rid in list(self._streams):
                    self.engine.abort_request(rid)
                return False
            if kind == "add":
                _, prompt, params, request_id, stream, done, prepared, priority, lora_request = cmd
                try:
                    if request_id in self._streams:
                        raise ValueError(f"request id {request_id!r} is already in use")
                    if isinstance(params, BeamSearchParams):
                        self.engine.add_beam_search(prompt, params, request_id, prepared=prepared,
                                                    lora_request=lora_request)
                    else:
                        self.engine.add_request(prompt, params, request_id, prepared=prepared, priority=priority,
                                                lora_request=lora_request)
                except Exception as e:  # noqa: BLE001 - bad input goes back to the caller
                    done.set_exception(e)
                else:
                    self._streams[request_id] = stream
                    done.set_result(request_id)
            elif kind == "call":
                _, fn, args, done = cmd
                try:
                    done.set_result(fn(*args))
                except Exception as e:  # noqa: BLE001 - the caller's failure
                    done.set_exception(e)
            elif kind == "abort":
                rid = cmd[1]
                self.engine.abort_request(rid)
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream.put(_Aborted)

    def _fail_requests(self, request_ids: list[str], error: Exception) -> None:
        """After a failed forward: tell and abort the requests of that step only."""
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(error)
            self.engine.abort_request(rid)

    def _fail_all(self, error: Exception) -> None:
        """After a failed step: tell every waiting request, abort them all to free their blocks."""
        for rid, stream in list(self._streams.items()):
            stream.put(error)
        try:
            for rid in list(self._streams):
                self.engine.abort_request(rid)
            for req in list(self.engine.scheduler.waiting) + list(self.engine.scheduler.running):
                self.engine.abort_request(req.request_id)
                if not req.is_finished():  # not in engine.requests any more: finish it directly
                    self.engine.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        finally:
            self._streams.clear()

    def _fail_pending_commands(self, error: BaseException) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[5].set_exception(EngineDeadError(f"the engine is not running: {error!r}"))
            elif cmd[0] == "call":
                cmd[3].set_exception(EngineDeadError(f"the engine is not running: {error!r}"))
