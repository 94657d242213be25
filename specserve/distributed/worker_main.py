"""What a tensor-parallel worker process runs: join the group, then serve the driver until shutdown.

``spawned_worker_main`` is the entry point of a worker the driver spawned (one node);
``run_env_worker`` that of a rank started from outside, torchrun style. Either way the
worker says hello on its control connection, builds its end of the process group
from the driver's ``init`` message and runs ``serve`` (``worker/tp_executor.py``'s loop).
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import parent_process
from multiprocessing.connection import Client, Connection
from multiprocessing.connection import wait as wait_for_connections

import torch
import torch.distributed as dist

from specserve.distributed.launch_env import (
    CONTROL_KEY,
    ENV_VARS,
    GROUP_PREFIX,
    ServeFn,
    device_for,
    env_launch,
    env_store,
    startup_timeout_s,
)
from specserve.distributed.parallel_state import TensorParallelGroup, create_process_group


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
    store = env_store(env)
    addr, port, key = pickle.loads(store.get(CONTROL_KEY))  # waits until the driver has published it
    conn = Client((addr, port), family="AF_INET", authkey=key)
    _join_and_serve(conn, store, env.rank, env.world_size, env.local_rank, serve, loopback=False)


def _join_and_serve(
    conn: Connection, store, rank: int, world_size: int, local_rank: int, serve: ServeFn, loopback: bool
) -> None:
    try:
        conn.send(("hello", rank, os.getpid(), socket.gethostname()))
        kind, init = conn.recv()
        assert kind == "init", kind
        device = device_for(init["device_type"], local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pg = create_process_group(
            init["backend"], dist.PrefixStore(GROUP_PREFIX, store), rank, world_size,
            timedelta(seconds=init["startup_timeout_s"]), device, loopback=loopback,
        )
        pg.set_timeout(timedelta(seconds=init["timeout_s"]))
        serve(conn, TensorParallelGroup(rank, world_size, pg), device)
        pg.close()   # before closing conn: the driver waits for that (worker_control._close)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(1)  # the driver is gone: nobody to report to
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)
    conn.close()
