"""The C kernels' headers (cpu_kernels/*.h) are layered: each includes what it uses, at its top,
and the includes form no cycle (issue #44). Checked as the issue checks it: a file holding only
``#include "H"`` compiles (``cc -fsyntax-only``) for every header H, with ``-march=native`` and
with the flags the kernels are built with, and on x86-64 also for the CPUs whose code paths
``-march=native`` may leave out (AVX2 only, no F16C, AVX-512 with AMX); and alone it defines every
macro of its own that it defines inside the kernels (so no part of it is silently compiled out
for want of its includer's definitions, as amx_int8.h's was). Also: kernel_build's cache
key changes when a header does, and the package data ships every kernel file. Fast: about 50
syntax-only compiles of one header each; skipped without a C compiler."""
from __future__ import annotations

import fnmatch
import os
import platform
import re
import shutil
import subprocess
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest

from specserve.model_executor.layers import kernel_build
from specserve.model_executor.layers.quant_gemm import COMPILE_FLAGS

KERNEL_DIR = kernel_build.KERNEL_DIR
HEADERS = sorted(p.name for p in KERNEL_DIR.glob("*.h"))
KERNEL_FILES = sorted(p.name for p in KERNEL_DIR.glob("*.[ch]"))
PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"

LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
# Warnings that mean a header uses something it does not declare (errors in newer compilers).
STRICT = ["-Werror=implicit-function-declaration", "-Werror=implicit-int"]
X86_MARCHES = {
    "haswell": "AVX2 and F16C, no AVX-512 (VEC 8)",
    "x86-64": "no F16C: the kernels' stubs",
    "sapphirerapids": "AVX-512 VNNI and AMX (q8_act.h, amx_tiles.h, amx_int8.h)",
}
FLAG_SETS = {
    "native": ["-march=native"],
    "kernel flags": list(COMPILE_FLAGS),
    **{f"march={m}": [f"-march={m}"] for m in X86_MARCHES},
}


@lru_cache(maxsize=None)
def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@lru_cache(maxsize=None)
def _accepts(flags: tuple[str, ...]) -> bool:
    """Whether the compiler accepts these flags at all (on an empty translation unit)."""
    result = subprocess.run([_compiler(), "-fsyntax-only", *flags, "-x", "c", "-"], input="", capture_output=True,
                            text=True)
    return result.returncode == 0


def _macros(flags: tuple[str, ...], source: Path) -> set[str]:
    """The macros defined after preprocessing ``source`` (``cc -dM -E``)."""
    result = subprocess.run([_compiler(), "-dM", "-E", *flags, "-I", str(KERNEL_DIR), str(source)],
                            capture_output=True, text=True, check=True)
    return set(re.findall(r"^#define (\w+)", result.stdout, re.M))


@lru_cache(maxsize=None)
def _kernel_macros(flags: tuple[str, ...]) -> frozenset[str]:
    """The macros defined in any of the kernels (cpu_kernels/*.c) as they are built."""
    return frozenset().union(*(_macros(flags, c) for c in sorted(KERNEL_DIR.glob("*.c"))))


def _without_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _includes(name: str, folder: Path = KERNEL_DIR) -> list[str]:
    """The files that ``folder/name`` includes with ``#include "..."``, in order."""
    return LOCAL_INCLUDE.findall(_without_comments((folder / name).read_text()))


def _include_cycle(folder: Path) -> list[str] | None:
    """An include cycle among folder's *.c and *.h files (["a.h", "b.h", "a.h"]), or None."""
    graph = {p.name: _includes(p.name, folder) for p in sorted(folder.glob("*.[ch]"))}
    done: set[str] = set()

    def walk(path: list[str]) -> list[str] | None:
        for nxt in graph.get(path[-1], []):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = walk(path + [nxt])
                if found:
                    return found
        done.add(path[-1])
        return None

    for name in graph:
        found = None if name in done else walk([name])
        if found:
            return found
    return None


def test_every_local_include_names_a_kernel_file():
    for name in KERNEL_FILES:
        for inc in _includes(name):
            assert (KERNEL_DIR / inc).is_file(), f"{name} includes {inc}, which is not in {KERNEL_DIR}"


def test_include_graph_has_no_cycle():
    cycle = _include_cycle(KERNEL_DIR)
    assert cycle is None, "include cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_one(tmp_path: Path):
    (tmp_path / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "b.h").write_text('#include "c.h"\n')
    (tmp_path / "c.h").write_text('/* #include "x.h" in a comment is no include */\n#include "a.h"\n')
    (tmp_path / "k.c").write_text('#include "c.h"\n')
    assert _include_cycle(tmp_path) in (["a.h", "b.h", "c.h", "a.h"], ["c.h", "a.h", "b.h", "c.h"])
    (tmp_path / "c.h").write_text("int c;\n")
    assert _include_cycle(tmp_path) is None


def test_headers_include_at_the_top():
    """No ``#include "..."`` after the first line of code: a header included halfway down borrows
    the definitions above it, so it does not compile alone (the old quant_blocks.h did this)."""
    late = []
    for name in KERNEL_FILES:
        code_seen = None
        for number, line in enumerate(_without_comments((KERNEL_DIR / name).read_text()).splitlines(), 1):
            stripped = line.strip()
            if LOCAL_INCLUDE.match(line) and code_seen:
                late.append(f"{name}:{number} includes {LOCAL_INCLUDE.match(line).group(1)} after code at line "
                            f"{code_seen}")
            elif stripped and not stripped.startswith("#") and code_seen is None:
                code_seen = number
    assert not late, "\n".join(late)


@pytest.mark.parametrize("flag_set", list(FLAG_SETS))
@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_alone(header: str, flag_set: str, tmp_path: Path):
    if _compiler() is None:
        pytest.skip("no C compiler found (set CC)")
    flags = FLAG_SETS[flag_set]
    if flag_set.startswith("march=") and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{flag_set} is an x86-64 target")
    if not _accepts(tuple(flags)):
        pytest.skip(f"{_compiler()} does not accept {' '.join(flags)}")
    if _accepts(("-fopenmp",)):
        flags = [*flags, "-fopenmp"]   # the kernels' pragmas are checked too where OpenMP is there
    probe = tmp_path / "only_this_header.c"
    probe.write_text(f'#include "{header}"\n')
    cmd = [_compiler(), "-fsyntax-only", *flags, *STRICT, "-I", str(KERNEL_DIR), str(probe)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{header} does not compile alone ({' '.join(cmd)}):\n{result.stderr[-3000:]}"
    own = set(re.findall(r"^\s*#\s*define\s+(\w+)", (KERNEL_DIR / header).read_text(), re.M))
    missing = (own & _kernel_macros(tuple(flags))) - _macros(tuple(flags), probe)
    assert not missing, f"{header} alone leaves {sorted(missing)} undefined, which the kernels define: it leans on " \
                        "its includer's definitions"


def test_kernel_cache_key_covers_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A changed header gives a new build, not the cached library of the old one."""
    if _compiler() is None:
        pytest.skip("no C compiler found (set CC)")
    kernels = tmp_path / "cpu_kernels"
    kernels.mkdir()
    (kernels / "probe.c").write_text('#include "probe_value.h"\nint probe(void) { return PROBE_VALUE; }\n')
    (kernels / "probe_value.h").write_text("#define PROBE_VALUE 1\n")
    monkeypatch.setattr(kernel_build, "KERNEL_DIR", kernels)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert kernel_build.build_library("probe.c", ["-O1"]).probe() == 1
    (kernels / "probe_value.h").write_text("#define PROBE_VALUE 2\n")
    assert kernel_build.build_library("probe.c", ["-O1"]).probe() == 2
    assert len(list((tmp_path / "cache" / "kernels").glob("probe-*.so"))) == 2


def test_package_data_ships_every_kernel_file():
    if not PYPROJECT.is_file():
        pytest.skip("no pyproject.toml (an installed package)")
    globs = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]["specserve"]
    package = KERNEL_DIR.parents[2]   # specserve/
    missing = [name for name in KERNEL_FILES
               if not any(fnmatch.fnmatch((KERNEL_DIR / name).relative_to(package).as_posix(), g) for g in globs)]
    assert not missing, f"pyproject.toml's package-data leaves out {missing}"
