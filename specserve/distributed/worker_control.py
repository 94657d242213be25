"""The driver's control connections to its workers: messages, liveness, failures, shutdown.

``WorkerConnections`` is the half of ``launcher.WorkerGroup`` that runs once the
workers are connected: it sends them bytes, notices a worker that died, failed or
stopped answering (``check``, ``wait_for``, ``failure_from``) and turns that into one
``WorkerError`` naming the rank, and stops them all (``close``: a shutdown message,
then SIGTERM, then SIGKILL; also on garbage collection and at exit).
"""
from __future__ import annotations

import logging
import pickle
import signal
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from multiprocessing.connection import wait as wait_for_connections

import torch

from specserve.distributed.launch_env import WorkerError
from specserve.distributed.parallel_state import OwnedProcessGroup

logger = logging.getLogger(__name__)

_SHUTDOWN = pickle.dumps(("shutdown",))


@dataclass
class ConnectedWorker:
    rank: int
    conn: Connection
    process: object | None = None  # the spawned Process; None in env mode
    pid: int | None = None
    host: str = ""

    def describe(self) -> str:
        where = f" on {self.host}" if self.host and self.process is None else ""
        return f"rank {self.rank} (pid {self.pid}{where})"


@dataclass
class GroupState:
    """Everything ``close`` needs, apart from the group, so a finalizer can own it."""

    workers: list[ConnectedWorker] = field(default_factory=list)
    store: object | None = None
    listener: Listener | None = None
    pg: OwnedProcessGroup | None = None
    broken: str | None = None
    saved_num_threads: int | None = None
    closed: bool = False


def _close(state: GroupState) -> None:
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
        state.pg.close()   # its threads end here, not in interpreter teardown
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


class WorkerConnections:
    """The driver's side of the control connections to ranks 1..N-1 (``launcher.WorkerGroup`` starts them).

    All the state ``close`` needs lives in one ``GroupState`` that a weakref finalizer
    owns, so the workers are stopped even when the group is only garbage collected.
    """

    def __init__(self):
        self._state = GroupState()
        self._finalizer = weakref.finalize(self, _close, self._state)

    # ------------------------------------------------------------------ messages
    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._state.workers]

    def _worker(self, rank: int) -> ConnectedWorker:
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
    def _failure_of(self, w: ConnectedWorker) -> str:
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

    def _describe_message(self, w: ConnectedWorker, msg) -> str:
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
