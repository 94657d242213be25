"""The package's layers, checked from the source: no module imports itself back through
others (imports inside functions count), and no lower layer imports a higher one.

Layers, bottom up (docs/architecture.md): the base modules (config, sampling_params,
outputs, catalog, reasoning_formats, lora); model_executor, distributed, worker; structured_output; core and sample;
spec_decode; engine; entrypoints, training and bench on top.
"""
from __future__ import annotations

import ast
import collections
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "specserve"
BASE = {"config", "sampling_params", "beam_search_params", "outputs", "catalog", "reasoning_formats", "lora"}
TOP = {"entrypoints", "training", "bench", "specserve"}     # "specserve": the package's own __init__
# What each part may never import (its own part and the layers below it are allowed).
FORBIDDEN = {
    "base": {"model_executor", "distributed", "worker", "structured_output", "core", "sample", "spec_decode", "engine",
             "drafts"} | TOP,
    "model_executor": {"worker", "core", "sample", "spec_decode", "engine"} | TOP,
    "distributed": {"worker", "core", "sample", "spec_decode", "engine"} | TOP,
    "worker": {"core", "sample", "spec_decode", "engine"} | TOP,
    "structured_output": {"model_executor", "distributed", "worker", "core", "sample", "spec_decode", "engine"} | TOP,
    "core": {"model_executor", "distributed", "worker", "sample", "spec_decode", "engine"} | TOP,
    "sample": {"model_executor", "distributed", "worker", "core", "spec_decode", "engine"} | TOP,
    "spec_decode": {"engine"} | TOP,
    "engine": TOP,
}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    """module -> the specserve modules it imports anywhere in its file."""
    mods = _modules()

    def resolve(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph = collections.defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names if a.name.startswith("specserve")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specserve"):
                # `from specserve.x import y` imports the module y when there is one, else x
                targets = [resolve(f"{node.module}.{a.name}") for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t != name)
    return graph


def part_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "specserve"
    return "base" if parts[1] in BASE else parts[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


def test_the_checker_finds_a_cycle_and_a_layer_breach():
    fake = {"specserve.core.a": {"specserve.engine.b"}, "specserve.engine.b": {"specserve.core.a"}}
    assert cycles(fake) == [["specserve.core.a", "specserve.engine.b"]]
    assert breaches(fake) == ["specserve.core.a imports specserve.engine.b"]


def breaches(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        forbidden = FORBIDDEN.get(part_of(module), set())
        out += [f"{module} imports {t}" for t in sorted(targets) if part_of(t) in forbidden]
    return out


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_no_lower_layer_imports_a_higher_one(part):
    graph = {m: t for m, t in import_graph().items() if part_of(m) == part}   # (read only: the graph is cached)
    assert graph, f"no modules found for {part}"
    assert breaches(graph) == []
