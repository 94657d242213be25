"""The facts of the machine a bench run measured on: CPU, threads, GPU, versions, git revision, load."""
from __future__ import annotations

import os
import platform
import subprocess

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_has_amx() -> bool | None:
    """Whether the CPU has AMX tiles (the ``amx_tile`` flag), which specserve's GGUF kernels use
    where present; None where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        return None
    return None


def git_revision() -> str:
    """The checkout's short commit (+dirty when specserve/ has changes), else
    ``SPECSERVE_GIT_REVISION`` (a copy without .git, as on a GPU machine the checkout was sent
    to: benchmarks/gpu_check.sh), else "unknown"."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fallback = os.environ.get("SPECSERVE_GIT_REVISION") or "unknown"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "specserve"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return fallback
    return head + ("+dirty" if dirty else "") if head else fallback


def machine_facts() -> dict:
    import specserve

    versions = {"python": platform.python_version(), "torch": torch.__version__, "specserve": specserve.__version__}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    facts = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_amx": cpu_has_amx(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": versions,
        "git": git_revision(),
    }
    return facts


def memory_available() -> int | None:
    """Bytes the kernel says new allocations can still get (``MemAvailable``), or None where
    /proc/meminfo is missing (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_memory() -> int | None:
    """Bytes this process holds in memory now (resident set), or None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
