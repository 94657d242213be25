"""The catalog's real models for the slow tests that need them (skipped when their packages are absent)."""
from __future__ import annotations

from specserve import catalog


def installed_file(name: str) -> str | None:
    """The catalog model's GGUF file, assembled if needed; None when its packages are not installed."""
    try:
        return catalog.ensure_file(catalog.lookup(name))
    except (ValueError, OSError):
        return None
