"""The process group's owner: closing it ends gloo's threads now, not in interpreter teardown."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from specserve.distributed.parallel_state import OwnedProcessGroup, TensorParallelGroup, create_process_group


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_closing_an_owned_gloo_group_joins_its_threads_and_later_calls_fail_clearly():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    torch.ones(8).add_(1)   # any lazily started torch threads exist before the count
    before = _thread_count()
    group = create_process_group("gloo", store, 0, 1, timedelta(seconds=30), torch.device("cpu"), loopback=True)
    assert isinstance(group, OwnedProcessGroup)
    assert _thread_count() > before   # gloo's worker and transport threads
    tp = TensorParallelGroup(0, 1, group)
    x = torch.arange(4, dtype=torch.float32)
    tp.group.allreduce([x]).wait()
    for _ in range(20):   # not waited for: gloo's threads may hold the last reference to each
        group.allreduce([torch.ones(1024)])

    group.close()
    # gloo's own shutdown() leaves its threads running; dropping the group joins them.
    assert _thread_count() == before
    with pytest.raises(RuntimeError, match="process group is closed"):
        group.allreduce([x])
    group.close()   # idempotent
