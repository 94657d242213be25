"""bench/machine.py: the commit and the machine a results file records."""
from __future__ import annotations

import subprocess

from specserve.bench import machine
from specserve.bench.results import machine_kind, machine_line


def test_a_checkout_without_git_records_the_revision_it_was_given(monkeypatch):
    """A device machine gets the working tree without .git: git answers nothing, and the
    revision benchmarks/gpu_check.sh passes (SPECSERVE_GIT_REVISION) is recorded instead."""
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: subprocess.CompletedProcess(a, 128, "", "not a git repo"))
    monkeypatch.delenv("SPECSERVE_GIT_REVISION", raising=False)
    assert machine.git_revision() == "unknown"
    monkeypatch.setenv("SPECSERVE_GIT_REVISION", "abc1234")
    assert machine.git_revision() == "abc1234"


def test_a_checkout_with_git_records_its_commit(monkeypatch):
    monkeypatch.setenv("SPECSERVE_GIT_REVISION", "abc1234")
    revision = machine.git_revision()
    assert revision != "abc1234" and len(revision.split("+")[0]) >= 7


def test_memory_figures_are_read_where_proc_exists():
    import mmap
    import os

    from specserve.bench.machine import memory_available, process_memory

    if not os.path.exists("/proc/meminfo"):
        assert memory_available() is None and process_memory() is None
        return
    # A fresh anonymous mapping, touched page by page: 64 MiB more resident. (A bytearray may
    # reuse heap pages that earlier tests left resident, and then nothing grows.)
    block = mmap.mmap(-1, 64 << 20)
    before = process_memory()
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert process_memory() - before >= 60 << 20
    block.close()
    assert 0 < memory_available() < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_the_machine_kind_names_the_gpu_or_the_cpus_instructions():
    """Results files are grouped by it on the benchmarks page: a GPU, else torch's name for the CPU's
    vector instructions, with AMX tiles where the CPU has them."""
    facts = machine.machine_facts()
    assert facts["cpu_capability"] and facts["cpu_amx"] in (True, False, None)
    assert machine_kind({"cpu_capability": "AVX2", "cpu_amx": False}) == "AVX2"
    assert machine_kind({"cpu_capability": "AVX512", "cpu_amx": True}) == "AVX512 with AMX"
    assert machine_kind({"cpu_capability": "AVX512"}) == "AVX512"          # a file from before cpu_amx
    assert machine_kind({"cpu_capability": "AVX2", "cuda": "NVIDIA H200"}) == "GPU NVIDIA H200"
    assert "(AVX512 with AMX)" in machine_line({"cpu": "Xeon", "cpu_count": 2, "cpu_capability": "AVX512",
                                                "cpu_amx": True})
