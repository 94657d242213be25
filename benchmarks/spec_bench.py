"""Where the benchmarks find Spec-Bench's questions: the team's shared copy next to the project.

``../shared/data/spec_bench/question.jsonl`` from the project root (480 questions in 13
categories, one JSON object a line with ``category`` and ``turns``); every benchmark that
reads it takes ``--prompts`` to use another file of the same form.
"""
import os

SPEC_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "spec_bench",
                          "question.jsonl")
