"""Start, watch and stop the processes of a tensor-parallel group.

Rank 0 is always the **driver**: the process that runs the engine (scheduler,
proposer, sampler). Ranks 1..N-1 are **workers**: each holds its shard of every
model and runs the same forward as the driver when told to. Two ways to get them:

spawn (one node, the default)
    The driver starts N-1 worker processes with the ``spawn`` start method. They
    rendezvous on a TCPStore the driver opens on a free localhost port (port 0,
    so no race for a port) and talk to the driver over a private pipe.
env (one or several nodes, torchrun style)
    Every rank is started from outside with MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE (and LOCAL_RANK). Rank 0 opens (or, under torchrun, joins) the
    store at MASTER_ADDR:MASTER_PORT and listens on a control socket whose
    address and random key it publishes in the store; workers connect to it.

Control messages (model shards, step inputs, shutdown) go driver -> worker over
that connection; a worker answers only at start-up or to report an error.
Tensors of the forward travel in the tensor-parallel process group (gloo on
CPU, NCCL on CUDA), built straight from the store and never registered as
torch.distributed's default group.

Lifetimes. Spawned workers are daemons, ignore Ctrl-C (the driver decides when
they stop) and exit by themselves when the driver process dies (a watchdog
thread on the parent's sentinel) or their connection closes. The driver stops
them in ``close()``, which runs on an explicit call, when the group is garbage
collected, or at interpreter exit (a weakref finalizer): a shutdown message,
then SIGTERM, then SIGKILL. A dead worker is noticed before each step (process
and connection check) and inside one (gloo reports a closed connection at once;
a worker that hangs hits the collective timeout); either way the engine gets a
``WorkerError`` naming the rank, and the rest of the group is stopped.

A script that creates the engine at import time, without an
``if __name__ == "__main__":`` guard, would have each spawned worker (which
re-imports the main script) start an engine of its own: the worker notices
(``exit_if_bootstrapping``) and exits with ``UNGUARDED_MAIN_EXIT``, and the
driver raises a RuntimeError saying what to do (``UNGUARDED_MAIN_MESSAGE``).
"""
from __future__ import annotations

import logging
import os
import pickle
import secrets
import signal
import socket
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import AuthenticationError, current_process, parent_process
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.connection import wait as wait_for_connections
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from specserve.distributed.parallel_state import TensorParallelGroup, create_process_group

logger = logging.getLogger(__name__)

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
_CONTROL_KEY = "specserve/tp/control"
_GROUP_PREFIX = "specserve/tp/group"
_SHUTDOWN = pickle.dumps(("shutdown",))

# serve(conn, tp, device): a worker's loop; returns when the driver says shutdown.
ServeFn = Callable[[Connection, TensorParallelGroup, torch.device], None]


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def collective_timeout_s() -> float:
    """How long a collective may wait for a peer (a worker that hangs rather than dies)."""
    return _env_seconds("SPECSERVE_TP_TIMEOUT_S", 60.0)


def startup_timeout_s() -> float:
    """How long the driver waits for workers to start, connect and load their shards."""
    return _env_seconds("SPECSERVE_TP_STARTUP_TIMEOUT_S", 300.0)


class WorkerError(RuntimeError):
    """A tensor-parallel worker died, failed or stopped answering; the group is unusable."""


UNGUARDED_MAIN_EXIT = 78   # EX_CONFIG: a spawned worker found the engine being built while it imported __main__
UNGUARDED_MAIN_MESSAGE = (
    "tensor_parallel_size > 1 starts its worker processes with multiprocessing's 'spawn' method, which "
    "imports your main script again in each worker; this script creates the engine when it is imported, "
    "so every worker would start workers of its own. Put the code that creates the LLM (and uses it) "
    "under `if __name__ == \"__main__\":`, as with any spawn-based multiprocessing, or start every rank "
    "yourself with torchrun (docs/tensor_parallel.md)."
)


def exit_if_bootstrapping() -> None:
    """In a spawned process still importing the parent's main script, exit quietly with
    ``UNGUARDED_MAIN_EXIT`` rather than build an engine (the driver explains why).

    ``_inheriting`` is the flag multiprocessing itself checks before refusing to start a
    process from a process that has not finished bootstrapping.
    """
    if getattr(current_process(), "_inheriting", False):
        raise SystemExit(UNGUARDED_MAIN_EXIT)


@dataclass(frozen=True)
class EnvLaunch:
    """This process's place in a torchrun-style launch."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def env_launch() -> EnvLaunch | None:
    """The torchrun-style launch this process belongs to, or None (then workers are spawned)."""
    if not all(name in os.environ for name in ENV_VARS):
        return None
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        port = int(os.environ["MASTER_PORT"])
    except ValueError as e:
        raise ValueError(f"bad torchrun-style environment ({', '.join(ENV_VARS)}, LOCAL_RANK): {e}") from None
    if not (0 <= rank < world_size):
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    return EnvLaunch(rank, world_size, local_rank, os.environ["MASTER_ADDR"], port)


def _env_store(env: EnvLaunch) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT (rank 0 hosts it, or torchrun's agent does)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=startup_timeout_s())))
    return store


def _device_for(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class WorkerBoot:
    """What a spawned worker needs to join (pickled into the child)."""

    rank: int
    world_size: int
    store_port: int
    num_threads: int | None


def _exit_with_parent() -> None:
    """A daemon thread that ends this process as soon as the process that spawned it is gone."""
    parent = parent_process()
    ppid = os.getppid()

    def watch() -> None:
        while True:
            if parent is not None:
                if wait_for_connections([parent.sentinel], timeout=1.0):
                    break
            else:
                time.sleep(1.0)
            if os.getppid() != ppid:
                break
        os._exit(1)

    threading.Thread(target=watch, name="specserve-parent-watchdog", daemon=True).start()


def spawned_worker_main(boot: WorkerBoot, conn: Connection, serve: ServeFn) -> None:
    """Entry point of a worker process started by the driver (spawn mode)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    _exit_with_parent()
    if boot.num_threads:
        torch.set_num_threads(boot.num_threads)
    store = dist.TCPStore(
        "127.0.0.1", boot.store_port, boot.world_size, is_master=False,
        timeout=timedelta(seconds=startup_timeout_s()),
    )
    _join_and_serve(conn, store, boot.rank, boot.world_size, boot.rank, serve, loopback=True)


def run_env_worker(serve: ServeFn) -> None:
    """Serve as worker RANK of a torchrun-style launch until the driver (rank 0) shuts down."""
    env = env_launch()
    if env is None:
        raise RuntimeError(f"a tensor-parallel worker needs the environment variables {', '.join(ENV_VARS)}")
    if env.rank == 0:
        raise RuntimeError("RANK=0 is the driver: run the engine (LLM(...), specserve generate/serve) there")
    store = _env_store(env)
    addr, port, key = pickle.loads(store.get(_CONTROL_KEY))  # waits until the driver has published it
    conn = Client((addr, port), family="AF_INET", authkey=key)
    _join_and_serve(conn, store, env.rank, env.world_size, env.local_rank, serve, loopback=False)


def _join_and_serve(
    conn: Connection, store, rank: int, world_size: int, local_rank: int, serve: ServeFn, loopback: bool
) -> None:
    try:
        conn.send(("hello", rank, os.getpid(), socket.gethostname()))
        kind, init = conn.recv()
        assert kind == "init", kind
        device = _device_for(init["device_type"], local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pg = create_process_group(
            init["backend"], dist.PrefixStore(_GROUP_PREFIX, store), rank, world_size,
            timedelta(seconds=init["startup_timeout_s"]), device, loopback=loopback,
        )
        pg.set_timeout(timedelta(seconds=init["timeout_s"]))
        serve(conn, TensorParallelGroup(rank, world_size, pg), device)
        _shutdown_group(pg)   # before closing conn: the driver waits for that (see _close)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(1)  # the driver is gone: nobody to report to
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)
    conn.close()


def _shutdown_group(pg) -> None:
    """Stop a process group's communication threads now, while the interpreter is whole. Left to
    interpreter teardown, a gloo group whose peer is tearing down too can end the process in
    std::terminate ("terminate called without an active exception", seen under load)."""
    try:
        pg.shutdown()
    except Exception:
        pass


# --------------------------------------------------------------------------- driver side


def _start(proc) -> None:
    """``proc.start()``; in a process that is itself bootstrapping, the quiet exit of
    ``exit_if_bootstrapping`` (should the engine's earlier check not have caught it)."""
    exit_if_bootstrapping()
    try:
        proc.start()
    except RuntimeError as e:
        if "bootstrapping phase" in str(e):
            raise SystemExit(UNGUARDED_MAIN_EXIT) from None
        raise


@dataclass
class _Worker:
    rank: int
    conn: Connection
    process: object | None = None  # the spawned Process; None in env mode
    pid: int | None = None
    host: str = ""

    def describe(self) -> str:
        where = f" on {self.host}" if self.host and self.process is None else ""
        return f"rank {self.rank} (pid {self.pid}{where})"


@dataclass
class _State:
    """Everything ``close`` needs, apart from the group, so a finalizer can own it."""

    workers: list[_Worker] = field(default_factory=list)
    store: object | None = None
    listener: Listener | None = None
    pg: object | None = None
    broken: str | None = None
    saved_num_threads: int | None = None
    closed: bool = False


def _close(state: _State) -> None:
    """Stop every worker: a shutdown message, then SIGTERM, then SIGKILL. Idempotent."""
    if state.closed:
        return
    state.closed = True
    graceful = state.broken is None
    if graceful:
        for w in state.workers:
            try:
                w.conn.send_bytes(_SHUTDOWN)
            except Exception:
                pass
    deadline = time.monotonic() + (5.0 if graceful else 0.0)
    for w in state.workers:
        p = w.process
        if p is None:   # env mode: no process to join; wait until the worker has closed its end
            _wait_for_close(w.conn, deadline)
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for w in state.workers:
        try:
            w.conn.close()
        except Exception:
            pass
    if state.listener is not None:
        state.listener.close()
    if state.pg is not None:   # the workers' groups are down by now (joined, or closed their end)
        _shutdown_group(state.pg)
    state.pg = state.store = state.listener = None
    if state.saved_num_threads is not None:
        torch.set_num_threads(state.saved_num_threads)


def _wait_for_close(conn: Connection, deadline: float) -> None:
    """Until the worker closes its end of ``conn`` (it shuts its process group down first) or the deadline."""
    try:
        while wait_for_connections([conn], timeout=max(0.0, deadline - time.monotonic())):
            conn.recv_bytes()   # anything still in flight; EOFError once the worker has closed
    except (EOFError, OSError):
        pass


class WorkerGroup:
    """The driver's handle on ranks 1..N-1 (it is rank 0 itself).

    ``tp`` is the driver's TensorParallelGroup; ``device`` its device (cuda:LOCAL_RANK
    on CUDA). Messages are pickled once and sent as bytes to every worker.
    """

    def __init__(self, world_size: int, device: torch.device, serve: ServeFn):
        if world_size < 2:
            raise ValueError(f"a worker group needs a tensor-parallel size of at least 2, got {world_size}")
        self.world_size = world_size
        self.env = env_launch()
        self.timeout_s = collective_timeout_s()
        self.startup_timeout_s = startup_timeout_s()
        local_rank = self.env.local_rank if self.env else 0
        self.device = _device_for(device.type, local_rank)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._state = _State()
        self._finalizer = weakref.finalize(self, _close, self._state)
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if self.env is None:
                self._spawn(serve)
            else:
                self._accept(self.env)
            init = {
                "backend": self.backend, "device_type": self.device.type,
                "timeout_s": self.timeout_s, "startup_timeout_s": self.startup_timeout_s,
            }
            for w in self._state.workers:
                w.conn.send(("init", init))
            pg = create_process_group(
                self.backend, dist.PrefixStore(_GROUP_PREFIX, self._state.store), 0, world_size,
                timedelta(seconds=self.startup_timeout_s), self.device, loopback=self.env is None,
            )
            pg.set_timeout(timedelta(seconds=self.timeout_s))
            self._state.pg = pg
            self.tp = TensorParallelGroup(0, world_size, pg)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up
    def _spawn(self, serve: ServeFn) -> None:
        n = self.world_size
        if self.device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(
                f"tensor_parallel_size={n} needs {n} GPUs on this node, found {torch.cuda.device_count()}"
            )
        st = self._state
        num_threads = None
        if self.device.type == "cpu":
            # Share the cores: N processes each with every core would oversubscribe them.
            num_threads = max(1, torch.get_num_threads() // n)
            st.saved_num_threads = torch.get_num_threads()
            torch.set_num_threads(num_threads)
        st.store = dist.TCPStore(
            "127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=self.startup_timeout_s),
        )
        ctx = torch_mp.get_context("spawn")
        for rank in range(1, n):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            boot = WorkerBoot(rank, n, st.store.port, num_threads)
            proc = ctx.Process(
                target=spawned_worker_main, args=(boot, child_conn, serve),
                name=f"specserve-tp-worker-{rank}", daemon=True,
            )
            _start(proc)
            child_conn.close()
            st.workers.append(_Worker(rank, parent_conn, proc, proc.pid))
        try:
            hellos = self.wait_for("hello", self.startup_timeout_s)
        except WorkerError:
            if any(w.process.exitcode == UNGUARDED_MAIN_EXIT for w in st.workers):
                raise RuntimeError(UNGUARDED_MAIN_MESSAGE) from None
            raise
        for rank, msg in hellos.items():
            self._worker(rank).host = msg[3]

    def _accept(self, env: EnvLaunch) -> None:
        n = self.world_size
        if env.world_size != n:
            raise ValueError(
                f"tensor_parallel_size={n} but WORLD_SIZE={env.world_size}: in a torchrun-style launch "
                "every rank is one tensor-parallel rank, so they must match"
            )
        if env.rank != 0:
            raise RuntimeError(f"only RANK=0 runs the engine; this process has RANK={env.rank}")
        st = self._state
        st.store = _env_store(env)
        key = secrets.token_bytes(32)
        st.listener = Listener(("0.0.0.0", 0), family="AF_INET", authkey=key)
        port = st.listener.address[1]
        addr = os.environ.get("SPECSERVE_DRIVER_ADDR", env.master_addr)
        st.store.set(_CONTROL_KEY, pickle.dumps((addr, port, key)))
        raw = getattr(getattr(st.listener, "_listener", None), "_socket", None)
        if raw is not None:
            raw.settimeout(1.0)  # so a missing worker cannot block start-up forever
        deadline = time.monotonic() + self.startup_timeout_s
        by_rank: dict[int, _Worker] = {}
        while len(by_rank) < n - 1:
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"only {len(by_rank)} of {n - 1} workers connected within {self.startup_timeout_s:.0f} s; "
                    f"start ranks 1..{n - 1} with the same MASTER_ADDR/MASTER_PORT/WORLD_SIZE "
                    "(see docs/tensor_parallel.md)"
                )
            try:
                conn = st.listener.accept()
            except (TimeoutError, socket.timeout, AuthenticationError):
                continue
            if not conn.poll(self.startup_timeout_s):
                conn.close()
                continue
            kind, rank, pid, host = conn.recv()
            if kind != "hello" or not (1 <= rank < n) or rank in by_rank:
                conn.close()
                raise WorkerError(f"unexpected hello from a worker claiming rank {rank}")
            by_rank[rank] = _Worker(rank, conn, None, pid, host)
        st.workers = [by_rank[r] for r in range(1, n)]

    # ------------------------------------------------------------------ messages
    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._state.workers]

    def _worker(self, rank: int) -> _Worker:
        return self._state.workers[rank - 1]

    def send(self, rank: int, payload) -> None:
        """Send bytes (or any buffer) to one worker."""
        w = self._worker(rank)
        try:
            w.conn.send_bytes(payload)
        except (OSError, EOFError, ValueError) as e:
            raise self.fail(f"could not reach tensor-parallel worker {w.describe()}: {e}") from None

    def send_all(self, payload: bytes) -> None:
        for w in self._state.workers:
            self.send(w.rank, payload)

    def check(self) -> None:
        """Raise WorkerError if the group broke or a worker died or reported an error."""
        st = self._state
        if st.broken is not None:
            raise WorkerError(st.broken)
        for w in st.workers:
            if (w.process is not None and not w.process.is_alive()) or w.conn.poll():
                raise self.fail(self._failure_of(w))

    def wait_for(self, kind: str, timeout_s: float) -> dict[int, tuple]:
        """One ``(kind, rank, ...)`` reply from every worker, watching that they stay alive."""
        if self._state.broken is not None:
            raise WorkerError(self._state.broken)
        pending = {w.rank: w for w in self._state.workers}
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            for w in pending.values():
                if w.process is not None and not w.process.is_alive() and not w.conn.poll():
                    raise self.fail(self._failure_of(w))
            ready = wait_for_connections([w.conn for w in pending.values()], timeout=1.0)
            for w in [w for w in pending.values() if w.conn in ready]:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    raise self.fail(self._failure_of(w)) from None
                if msg[0] != kind:
                    raise self.fail(self._describe_message(w, msg))
                replies[w.rank] = msg
                del pending[w.rank]
            if pending and time.monotonic() > deadline:
                ranks = ", ".join(w.describe() for w in pending.values())
                raise self.fail(f"tensor-parallel workers {ranks} did not answer {kind!r} within {timeout_s:.0f} s")
        return replies

    # ------------------------------------------------------------------ failures
    def _failure_of(self, w: _Worker) -> str:
        """Why worker ``w`` is gone: its own error report if it sent one, else its exit."""
        try:
            if w.conn.poll():
                return self._describe_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        if w.process is not None:
            w.process.join(1.0)
            code = w.process.exitcode
            if code is not None and code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            elif code is not None:
                how = f"exited with code {code}"
            else:
                how = "closed its connection"
            return f"tensor-parallel worker {w.describe()} {how}"
        return f"tensor-parallel worker {w.describe()} closed its connection (it died or was stopped)"

    def _describe_message(self, w: _Worker, msg) -> str:
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            return f"tensor-parallel worker {w.describe()} failed:\n{msg[2]}"
        return f"unexpected message from tensor-parallel worker {w.describe()}: {msg!r:.200}"

    def fail(self, reason: str) -> WorkerError:
        """Mark the group broken, stop every worker, and return the error to raise."""
        st = self._state
        if st.broken is None:
            st.broken = f"{reason}\nThe tensor-parallel group has been shut down; create a new engine."
            logger.debug("%s", st.broken)
        self.close()
        return WorkerError(st.broken)

    def failure_from(self, exc: BaseException) -> WorkerError:
        """The error for ``exc`` raised on the driver inside a step: name a dead worker if there is one."""
        deadline = time.monotonic() + 2.0  # a worker that just died may not have been reaped yet
        while True:
            for w in self._state.workers:
                if (w.process is not None and not w.process.is_alive()) or w.conn.poll():
                    return self.fail(self._failure_of(w))
            if time.monotonic() > deadline:
                return self.fail(f"the tensor-parallel step failed on rank 0: {type(exc).__name__}: {exc}")
            time.sleep(0.05)

    @property
    def broken(self) -> bool:
        return self._state.broken is not None

    def close(self) -> None:
        """Stop the workers (idempotent; also runs on garbage collection and at exit)."""
        self._finalizer()
