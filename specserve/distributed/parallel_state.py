"""The tensor-parallel group a model runs in, passed explicitly (no module globals).

A target at TP N and a draft at TP 1 can live in one process because each
model holds its own ``TensorParallelGroup``.

``group`` is an ``OwnedProcessGroup`` made by ``create_process_group``: a gloo or
NCCL backend built straight from a store, never registered as torch.distributed's
default group, so two engines (or a test and an engine) in one process never
collide, and held through one owner that can end its threads (``close``).
Collectives are called as methods on it. Any object with the same
``allreduce`` / ``allgather`` / ``gather`` methods works (a registered
``ProcessGroup`` too; the unit tests pass an in-process fake).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: object | None = None   # a process group (see module doc) when world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the engine, the scheduler and the sampler."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks, in place."""
        if self.world_size == 1:
            return x
        self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's shard along the last dimension, on every rank."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def gather_last_dim(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """Concatenate every rank's shard along the last dimension on rank ``dst`` only.

        Other ranks get ``None``: only the driver needs logits, so the LM head
        sends each shard once instead of to every rank.
        """
        if self.world_size == 1:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = dst
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == dst else []
        self.group.gather([parts] if parts else [], [x], opts).wait()
        return torch.cat(parts, dim=-1) if self.rank == dst else None

    def shard(self, size: int, what: str, num_units: int | None = None) -> tuple[int, int]:
        """(start, length) of this rank's slice of a dimension of ``size``.

        The dimension is made of ``num_units`` equal units that must not be cut
        (attention heads grouped by KV head; default: single elements). Units
        are dealt out as evenly as possible, the first ranks taking one more
        when they do not divide evenly: 3 KV heads on 2 ranks are 2 + 1. Uneven
        splits let models such as the default one (9 query / 3 KV heads) run at
        any tensor-parallel size up to their KV head count; rank 0 then does a
        little more work than the others.
        """
        units = size if num_units is None else num_units
        if units <= 0 or size % units:
            raise ValueError(f"{what} ({size}) is not a whole number of {units} units")
        if units < self.world_size:
            raise ValueError(
                f"{what} ({units}) is smaller than the tensor-parallel size {self.world_size}: "
                "every rank needs at least one"
            )
        unit = size // units
        base, extra = divmod(units, self.world_size)
        first = self.rank * base + min(self.rank, extra)
        count = base + (1 if self.rank < extra else 0)
        return first * unit, count * unit


SINGLE = TensorParallelGroup()


class OwnedProcessGroup:
    """The one reference to a process group, so that ``close`` ends its threads at once.

    Why it exists: gloo's ``shutdown()`` leaves the group's worker threads running;
    only its destructor drains their queue and joins them. Left to interpreter
    teardown, a worker thread that drops the last reference to a finished
    collective must take the GIL to free the collective's tensors, and a thread
    that asks for the GIL while the interpreter finalizes is ended by
    ``pthread_exit``, which the C++ runtime turns into std::terminate ("terminate
    called without an active exception": rank 0 of a torchrun-style launch, 3 exits
    in about 365 under load; docs/tensor_parallel.md). Models hold this owner (through
    ``TensorParallelGroup``), never the group itself, so ``close`` drops the last
    reference and the destructor runs while the interpreter is whole.
    """

    def __init__(self, pg) -> None:
        self._pg = pg

    def _group(self):
        if self._pg is None:
            raise RuntimeError("the tensor-parallel process group is closed (the engine's workers were stopped)")
        return self._pg

    def allreduce(self, tensors: list[torch.Tensor]):
        return self._group().allreduce(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]):
        return self._group().allgather(outputs, inputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: dist.GatherOptions):
        return self._group().gather(outputs, inputs, opts)

    def set_timeout(self, timeout: timedelta) -> None:
        self._group().set_timeout(timeout)

    def close(self) -> None:
        """Shut the group down and drop it: its destructor joins its threads. Idempotent."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            pg.shutdown()   # NCCL: ends its communicators; gloo: nothing (the destructor does it)
        except Exception:
            pass
        del pg   # the last reference: the destructor runs here, with the GIL released


def create_process_group(
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    device: torch.device,
    loopback: bool = False,
) -> OwnedProcessGroup:
    """A gloo (CPU) or NCCL (CUDA) process group over ``store``, not registered globally.

    Every rank must call this with the same store (prefix) and world size; it
    returns once all of them have connected (or raises after ``timeout``).
    ``loopback`` pins gloo to 127.0.0.1 (all ranks on this machine).
    """
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [
            dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
            if loopback
            else dist.ProcessGroupGloo.create_default_device()
        ]
        pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
    elif backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("this PyTorch build has no NCCL; tensor parallelism on CUDA needs a CUDA build of torch")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        pg.eager_connect_single_device(device)
    else:
        raise ValueError(f"unknown process-group backend {backend!r}; use 'gloo' or 'nccl'")
    if hasattr(pg, "_set_sequence_number_for_group"):
        pg._set_sequence_number_for_group()
    return OwnedProcessGroup(pg)
