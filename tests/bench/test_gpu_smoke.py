"""benchmarks/gpu_smoke.py, the first stage of the GPU check, on this CPU: graphs and the Triton
kernel emulated, as tests/worker/test_cuda_graphs.py runs them (slow: the interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_the_gpu_smoke_check_passes_in_the_cpu_emulation():
    pytest.importorskip("triton")
    env = dict(os.environ, SPECSERVE_GRAPHS_ON_CPU="1", SPECSERVE_TRITON_ON_CPU="1", TRITON_INTERPRET="1",
               SPECSERVE_CPU_ATTENTION="torch", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_smoke.py"), "--device", "cpu",
                           "--shape", "tiny"],   # the script's logic; the GPU runs its 135M shape
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines[:3]] == ["PASS"] * 3, done.stdout
