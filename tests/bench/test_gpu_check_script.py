"""benchmarks/gpu_check.sh, read here: every `specserve bench` line parses, and its prompts come
from the checkout. Only the checkout travels to the device machine (../shared does not), so a
preset that reads Spec-Bench from there would fail there after minutes of a lease."""
from __future__ import annotations

import os
import re
import shlex

from specserve.bench.options import prompts_path
from specserve.entrypoints.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
# The script's variables, as it sets them on the device (TARGET: the shipped draft).
VARIABLES = {"$OUT": "/tmp/out", "$LIMIT_BW": "4800", "$TARGET": "specserve/drafts/smollm2-135m-draft",
             "$attention": "triton"}


def bench_commands() -> list[list[str]]:
    """The arguments after `$SPECSERVE` of every bench line (continuation lines joined)."""
    with open(SCRIPT) as f:
        text = f.read().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if "$SPECSERVE bench" not in line:
            continue
        line = line.split("$SPECSERVE", 1)[1].split(">>")[0]
        line = re.sub(r"\$\{TARGET:\+--model \$TARGET\}", "--model $TARGET", line)
        for name, value in VARIABLES.items():
            line = line.replace(name, value)
        commands.append(shlex.split(line))
    return commands


def test_every_bench_line_parses_and_reads_prompts_from_the_checkout():
    commands = bench_commands()
    assert len(commands) >= 5 and {c[1] for c in commands} >= {"gpu-steps", "spec-bench", "batch-scaling", "attention"}
    for argv in commands:
        args = build_parser().parse_args(argv)
        if hasattr(args, "prompts"):
            path = os.path.realpath(os.path.join(ROOT, prompts_path(args.prompts)))
            assert path.startswith(ROOT + os.sep) and os.path.exists(path), (argv, path)
