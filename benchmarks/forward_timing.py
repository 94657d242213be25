"""One model forward over a step's rows, timed for several engines side by side (``before_after.py
--forwards`` uses it).

A forward of ``rows`` new tokens at context 64 is a decode step (1 row) or the verification of
``rows - 1`` drafted tokens. Every round runs each row count on every engine back to back (a
warm-up call, then two timed calls), so a slow spell of the machine lands on all of them alike.
"""
from __future__ import annotations

import os
import statistics
from typing import Callable

from specserve.bench.suites import forward_rows

CONTEXT = 64   # tokens already in the KV cache before the timed rows


def with_amx(enabled: bool, build: Callable):
    """build() with specserve's AMX kernels allowed or not (``SPECSERVE_CPU_AMX``, read when an engine
    packs its matrices at the end of loading), the variable restored afterwards."""
    old = os.environ.get("SPECSERVE_CPU_AMX")
    os.environ["SPECSERVE_CPU_AMX"] = "on" if enabled else "off"
    try:
        return build()
    finally:
        if old is None:
            del os.environ["SPECSERVE_CPU_AMX"]
        else:
            os.environ["SPECSERVE_CPU_AMX"] = old


def time_forwards(llms: dict, rows_list: list[int], rounds: int,
                  before: Callable[[str], None] | None = None) -> dict[tuple[str, int], float]:
    """{(engine name, rows): median ms} (``specserve bench forward-rows``' timing, at CONTEXT)."""
    times = forward_rows.time_forwards(llms, rows_list, rounds, CONTEXT, before)
    return {key: statistics.median(values) for key, values in times.items()}


def print_table(medians: dict[tuple[str, int], float], names: list[str], rows_list: list[int],
                ratio: tuple[str, str] | None = None) -> None:
    """A markdown table of ms by row count, with ratio[0] / ratio[1] as a last column if given."""
    extra = f" | {ratio[0]} / {ratio[1]}" if ratio else ""
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + extra + " |\n|---|"
          + "---|" * (len(names) + (1 if ratio else 0)))
    for rows in rows_list:
        cells = " | ".join(f"{medians[n, rows]:.1f}" for n in names)
        last = f" | {medians[ratio[0], rows] / medians[ratio[1], rows]:.2f}x" if ratio else ""
        print(f"| {rows} | {cells}{last} |", flush=True)
