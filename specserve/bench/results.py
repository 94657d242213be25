"""Results files: what every ``specserve bench`` suite writes, and what docs/benchmarks.md is made from.

One run of one suite is one gzipped JSON file, ``RESULTS_DIR/<suite>/<UTC time>.json.gz`` (``zcat``
shows it; plain ``.json`` files are read too)::

    {"schema": 1, "suite": "llama-bench", "question": "...", "command": "specserve bench llama-bench ...",
     "date": "2026-12-05T11:30:00Z", "commit": "3cd1df9", "machine": {machine_facts()},
     "params": {...the suite's options...},
     "table": {"columns": [...], "rows": [[...], ...]},   # what the benchmarks page shows
     "notes": ["one line each", ...],                     # how to read the table (optional)
     "samples": ...}                                      # the raw measurements the table was computed from

The newest file of each suite is that suite's current answer (``latest``); the older ones are its
history. ``source`` (optional) says where a file's figures came from when they were not measured by
this command (files converted from earlier scripts' raw output).

Why gzip: the raw samples make a file 0.1-1.4 MB of JSON, about 15 times that gzipped, and the
checkout travels whole to a GPU machine whose limit is 64 MiB.
"""
from __future__ import annotations

import datetime
import glob
import gzip
import json
import os

SCHEMA = 1
DEFAULT_RESULTS_DIR = "bench-results"
REQUIRED = ("suite", "question", "command", "date", "commit", "machine", "table")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_results(suite: str, question: str, command: str, params: dict, machine: dict | None = None) -> dict:
    """The envelope of one run (table and samples are filled in by the suite)."""
    from specserve.bench.machine import machine_facts

    machine = machine if machine is not None else machine_facts()
    return {"schema": SCHEMA, "suite": suite, "question": question, "command": command, "date": utc_now(),
            "commit": machine.get("git", "unknown"), "machine": machine, "params": params,
            "table": {"columns": [], "rows": []}, "notes": [], "samples": None}


def check(doc: dict, where: str = "results") -> None:
    """ValueError naming what a results document lacks (so a broken file fails loudly, not as a blank table)."""
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    cols, rows = doc["table"].get("columns"), doc["table"].get("rows")
    if not cols or rows is None or any(len(r) != len(cols) for r in rows):
        raise ValueError(f"{where}: the table needs columns and rows of as many cells")


def save(doc: dict, results_dir: str | None = None) -> str:
    """Write ``doc`` as ``results_dir/<suite>/<date>.json.gz``; returns the path."""
    check(doc)
    folder = os.path.join(results_dir or DEFAULT_RESULTS_DIR, doc["suite"])
    os.makedirs(folder, exist_ok=True)
    stamp = doc["date"].replace(":", "").replace("-", "")
    path = os.path.join(folder, f"{stamp}.json.gz")
    n = 1
    while os.path.exists(path):   # two runs in one second
        n += 1
        path = os.path.join(folder, f"{stamp}-{n}.json.gz")
    write_json(path, doc)
    return path


def write_json(path: str, doc) -> None:
    """``doc`` as JSON at ``path``, gzipped when it ends in .gz (without a time stamp: the bytes
    depend on the document alone)."""
    text = json.dumps(doc, indent=1) + "\n"
    if path.endswith(".gz"):
        with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as z:
            z.write(text.encode())
    else:
        with open(path, "w") as f:
            f.write(text)


def read_json(path: str):
    """A JSON file, gzipped (.gz) or not."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def results_files(results_dir: str, suite: str = "*") -> list[str]:
    """The results files under ``results_dir`` (of ``suite``), gzipped or not, sorted by name."""
    return sorted(glob.glob(os.path.join(results_dir, suite, "*.json")) +
                  glob.glob(os.path.join(results_dir, suite, "*.json.gz")))


def load(path: str) -> dict:
    doc = read_json(path)
    check(doc, path)
    return doc


def latest(results_dir: str) -> dict[str, dict]:
    """{suite: its newest results document} under ``results_dir`` (newest by the date inside), on
    whatever machine."""
    return {suite: docs[0] for suite, docs in latest_by_machine_kind(results_dir).items()}


def machine_kind(m: dict) -> str:
    """What a suite's figures depend on most, beyond the code: the GPU where one ran, else the
    CPU's vector instructions as torch names them (AVX2, AVX512) and whether it has AMX tiles
    (older results files do not say): specserve's CPU kernels have a path for each."""
    if m.get("cuda"):
        return f"GPU {m['cuda']}"
    return (m.get("cpu_capability") or "CPU") + (" with AMX" if m.get("cpu_amx") else "")


def latest_by_machine_kind(results_dir: str) -> dict[str, list[dict]]:
    """{suite: its newest results document for each machine kind, the newest first}."""
    best: dict[tuple[str, str], dict] = {}
    for path in results_files(results_dir):
        doc = load(path)
        key = (doc["suite"], machine_kind(doc["machine"]))
        if key not in best or doc["date"] >= best[key]["date"]:
            best[key] = doc
    out: dict[str, list[dict]] = {}
    for (suite, _), doc in best.items():
        out.setdefault(suite, []).append(doc)
    return {suite: sorted(docs, key=lambda d: d["date"], reverse=True) for suite, docs in out.items()}


def machine_line(m: dict) -> str:
    """One line naming the machine: CPU, cores, its vector instructions, threads used, GPU, and how
    loaded it was."""
    text = f"{m.get('cpu', 'unknown CPU')}, {m.get('cpu_count', '?')} cores"
    if m.get("cpu_capability") and not m.get("cuda"):
        text += f" ({machine_kind(m)})"
    if m.get("torch_threads"):
        text += f", torch threads {m['torch_threads']}"
    if m.get("cuda"):
        text += f", GPU {m['cuda']}"
    if m.get("loadavg_start"):   # a shared machine: how busy it was (1-minute load average)
        text += f", load average {m['loadavg_start'][0]:.1f} at the start"
        if m.get("loadavg_end"):
            text += f", {m['loadavg_end'][0]:.1f} at the end"
    return text


def markdown_table(table: dict) -> list[str]:
    """A results table ({"columns": [...], "rows": [[...], ...]}) as Markdown lines: the page's
    tables and what ``specserve bench`` prints when a run ends."""
    cols = table["columns"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
    return lines


def table_lines(doc: dict) -> list[str]:
    """A results file's table in Markdown, then its notes as a list (the page's and the terminal's)."""
    notes = [f"- {note}" for note in doc.get("notes") or []]
    return markdown_table(doc["table"]) + ([""] + notes if notes else [])


def fmt(x, digits: int = 1, suffix: str = "") -> str:
    """A table cell: numbers rounded, None as a dash."""
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}f}{suffix}"
    return f"{x}{suffix}"
