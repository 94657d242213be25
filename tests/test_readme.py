"""The README's promises that a test can hold: CI runs exactly its test command, it stays short,
and every `specserve bench` command in its "How fast" table is one the command line accepts."""
from __future__ import annotations

import os
import re
import shlex

from specserve.entrypoints.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _setup_commands() -> list[str]:
    setup = _readme().split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, re.S)


def test_ci_runs_exactly_the_readme_test_command():
    commands = _setup_commands()
    assert len(commands) == 2 and " && python -m pytest -q" in commands[1]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [line for line in f.read().splitlines() if line.strip() and not line.startswith("#")]
    assert lines[-1] == commands[1]


def test_command_one_speculates():
    """First contact shows speculation: command 1 turns a proposer on and parses as written."""
    cmd = _setup_commands()[0].split(" && ")[-1]
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    assert args.command == "generate" and args.speculative_method is not None and args.chat


def test_readme_is_short_and_every_figure_has_a_command_that_parses():
    text = _readme()
    assert len(text.splitlines()) <= 220
    how_fast = text.split("## How fast", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in how_fast.splitlines() if r.startswith("| ") and not r.startswith("| question")]
    assert rows
    for row in rows:
        cmd = re.findall(r"`(specserve bench[^`]*)`", row)
        assert len(cmd) == 1, row
        build_parser().parse_args(shlex.split(cmd[0])[1:])   # SystemExit if the command line refuses it
