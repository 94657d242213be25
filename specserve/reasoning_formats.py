"""How thinking models mark their reasoning: one place for the tags and each format's rule.

Models such as DeepSeek-R1 and Qwen3 write their reasoning between ``<think>`` and
``</think>``, then the answer. The formats differ only in where the output starts:

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output starts
  inside the reasoning (a leading ``<think>`` may still be written);
- ``qwen3``: the output is reasoning only when it starts with ``<think>``; otherwise it is all
  answer (Qwen3 with ``enable_thinking`` off, or a model that does not think).

Two users read them: the chat API's reasoning parser (``entrypoints/openai/reasoning.py``),
which splits an answer's text, and structured output after reasoning
(``structured_output/compiler.py``), whose grammar leaves the reasoning free and constrains
the answer after ``</think>``.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"

# format name -> whether the output starts inside the reasoning
STARTS_INSIDE: dict[str, bool] = {"deepseek_r1": True, "qwen3": False}
