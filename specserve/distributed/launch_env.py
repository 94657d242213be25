"""What the driver and the workers of a tensor-parallel launch agree on.

The torchrun-style environment (``env_launch``) and its store, the store keys, the
timeouts (``SPECSERVE_TP_TIMEOUT_S``, ``SPECSERVE_TP_STARTUP_TIMEOUT_S``), the error
a broken group raises (``WorkerError``), the quiet exit of a worker that found an
unguarded main script (``exit_if_bootstrapping``). ``launcher.py`` tells the whole
story.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import current_process
from multiprocessing.connection import Connection
from typing import Callable

import torch
import torch.distributed as dist

from specserve.distributed.parallel_state import TensorParallelGroup

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
CONTROL_KEY = "specserve/tp/control"   # where rank 0 publishes its control socket (env mode)
GROUP_PREFIX = "specserve/tp/group"    # the process group's keys in the store

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


def env_store(env: EnvLaunch) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT (rank 0 hosts it, or torchrun's agent does)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=startup_timeout_s())))
    return store


def device_for(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")

