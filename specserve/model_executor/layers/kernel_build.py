"""Compiling specserve's C kernels on first use (``cpu_kernels/*.c``).

Each kernel (with the shared headers ``cpu_kernels/*.h``) is built with the system C compiler (``cc``, or ``$CC``) into
``~/.cache/specserve/kernels`` (``$SPECSERVE_CACHE_DIR``), under a name keyed by
the source, the compiler, the flags and the CPU's feature flags (the kernels are
built with ``-march=native``), and loaded through ctypes. With ``-fopenmp`` a
kernel links ``libgomp.so.1``, which resolves to the copy torch already loaded,
so its parallel loops run on torch's own worker threads; a compiler without
OpenMP builds the same kernel single-threaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).with_name("cpu_kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def build_library(source_name: str, flags: list[str]) -> ctypes.CDLL:
    """Compile ``cpu_kernels/<source_name>`` (cached) and load it; raises RuntimeError on failure."""
    source_path = KERNEL_DIR / source_name
    # The shared headers (gemm_core.h, ...) are part of every kernel's cache key.
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h")))
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    key = hashlib.sha256(source + _cpu_flags().encode() + compiler.encode() + " ".join(flags).encode())
    cache = Path(os.environ.get("SPECSERVE_CACHE_DIR", Path.home() / ".cache" / "specserve")) / "kernels"
    target = cache / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            base = [compiler, *flags, "-I", str(KERNEL_DIR), "-shared", "-fPIC", str(source_path), "-o", str(built)]
            result = subprocess.run(base + ["-fopenmp", "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                logger.info("building %s without OpenMP: %s", source_name, result.stderr[-500:])
                result = subprocess.run(base + ["-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(base)} failed:\n{result.stderr[-2000:]}")
            os.replace(built, target)  # atomic: concurrent processes never load a half-written file
    return ctypes.CDLL(str(target))


class LazyLibrary:
    """A kernel library built on first use, once per process (thread-safe).

    ``get()`` returns the loaded library, or None when it is turned off
    (``$<env_var>`` set to ``off_value``) or cannot be built; a build failure is
    logged once as a warning naming what runs instead.
    """

    def __init__(self, source_name: str, flags: list[str], setup, env_var: str, off_value: str, instead: str):
        self.source_name, self.flags, self.setup = source_name, flags, setup   # setup(lib): argtypes, checks
        self.env_var, self.off_value, self.instead = env_var, off_value, instead
        self.library: ctypes.CDLL | None = None
        self.attempted = False
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if self.attempted:   # the hot path (every matmul and attention call): no lock once settled
            return self.library
        with self._lock:
            if not self.attempted:
                try:
                    if os.environ.get(self.env_var) != self.off_value:
                        lib = build_library(self.source_name, self.flags)
                        self.setup(lib)
                        self.library = lib
                except Exception as exc:  # a missing compiler must not stop the engine
                    logger.warning("%s unavailable, using %s: %s", self.source_name, self.instead, exc)
                # Only now: a caller that sees attempted also sees the library (or None for good).
                self.attempted = True
            return self.library
