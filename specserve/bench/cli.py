"""``specserve bench`` from Python: ``main(argv)`` parses ``argv`` as the command line does and runs it.

The subcommand itself (its options, ``cmd_bench``) is ``command.py``, which
``specserve``'s command line (``entrypoints/cli.py``) imports; this module imports
that command line for its parser, so neither imports the other back.
"""
from __future__ import annotations

import sys

from specserve.bench.command import add_bench_parser, cmd_bench, options_from_args
from specserve.entrypoints.cli import build_parser

__all__ = ["add_bench_parser", "cmd_bench", "main", "options_from_args"]   # importable from here as before


def main(argv: list[str]) -> int:
    """``specserve bench ARGV...`` from Python, as the command line runs it (``argv``: bench's options).

    The report records ``specserve bench`` + ``argv`` as its command.
    """
    argv = ["bench", *argv]
    args = build_parser().parse_args(argv)
    try:
        return cmd_bench(args, argv)
    except ValueError as e:   # bad input: a clear message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
