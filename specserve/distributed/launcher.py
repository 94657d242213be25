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

This module starts the workers (``WorkerGroup``: spawned, or accepted from a
torchrun-style launch); the rest, one role a module:

    launch_env.py      what both sides agree on: torchrun environment, store keys, timeouts,
                       WorkerError, the unguarded-main exit
    worker_main.py     a worker's side: join the group, serve until shutdown
    worker_control.py  the driver's control connections: messages, liveness, failures, shutdown
"""
from __future__ import annotations

import os
import pickle
import secrets
import socket
import time
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from specserve.distributed.launch_env import (
    CONTROL_KEY,
    ENV_VARS,
    GROUP_PREFIX,
    UNGUARDED_MAIN_EXIT,
    UNGUARDED_MAIN_MESSAGE,
    EnvLaunch,
    ServeFn,
    WorkerError,
    collective_timeout_s,
    device_for,
    env_launch,
    env_store,
    exit_if_bootstrapping,
    startup_timeout_s,
)
from specserve.distributed.parallel_state import TensorParallelGroup, create_process_group
from specserve.distributed.worker_control import ConnectedWorker, WorkerConnections
from specserve.distributed.worker_main import WorkerBoot, run_env_worker, spawned_worker_main

# Importable from here as before the split (the engine and tp_executor import from this module).
__all__ = [
    "ENV_VARS", "UNGUARDED_MAIN_EXIT", "UNGUARDED_MAIN_MESSAGE", "EnvLaunch", "ServeFn", "WorkerBoot", "WorkerError",
    "WorkerGroup", "collective_timeout_s", "env_launch", "exit_if_bootstrapping", "run_env_worker",
    "spawned_worker_main", "startup_timeout_s",
]


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


class WorkerGroup(WorkerConnections):
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
        self.device = device_for(device.type, local_rank)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        super().__init__()   # the state close() needs, and its finalizer
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
                self.backend, dist.PrefixStore(GROUP_PREFIX, self._state.store), 0, world_size,
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
            st.workers.append(ConnectedWorker(rank, parent_conn, proc, proc.pid))
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
        st.store = env_store(env)
        key = secrets.token_bytes(32)
        st.listener = Listener(("0.0.0.0", 0), family="AF_INET", authkey=key)
        port = st.listener.address[1]
        addr = os.environ.get("SPECSERVE_DRIVER_ADDR", env.master_addr)
        st.store.set(CONTROL_KEY, pickle.dumps((addr, port, key)))
        raw = getattr(getattr(st.listener, "_listener", None), "_socket", None)
        if raw is not None:
            raw.settimeout(1.0)  # so a missing worker cannot block start-up forever
        deadline = time.monotonic() + self.startup_timeout_s
        by_rank: dict[int, ConnectedWorker] = {}
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
            by_rank[rank] = ConnectedWorker(rank, conn, None, pid, host)
        st.workers = [by_rank[r] for r in range(1, n)]
