"""The structured-output suite end to end on a tiny random model: every constrained answer is
schema-valid, the table has one row per configuration, and bad configurations are refused."""
from __future__ import annotations

import argparse

import pytest

from specserve.bench.suites import structured_output


def args(model: str, configs: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    structured_output.add_arguments(p)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(["--model", model, "--records", "2", "--max-tokens", "120", "--configs", configs])


@pytest.mark.usefixtures("one_torch_thread")
def test_constrained_answers_are_valid_and_tabled(tiny_llama_dir):
    doc = {}
    structured_output.run(args(tiny_llama_dir, "constrained,grammar,ngram+forced"), doc)
    rows = doc["table"]["rows"]
    assert [r[0] for r in rows] == ["`constrained`", "`grammar`", "`ngram+forced`"]
    for name in ("constrained", "grammar", "ngram+forced"):
        assert doc["samples"][name]["valid"] == doc["samples"][name]["answers"] == 2
    assert doc["samples"]["grammar"]["spec_decode"]["num_draft_tokens"] > 0     # forced tokens were drafted
    import specserve.engine.constraints as constraints

    assert constraints.Constraints.prepare.__qualname__ == "Constraints.prepare"   # the timing wrappers are gone


def test_unknown_configuration_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown configurations"):
        structured_output.run(args(tiny_llama_dir, "constrained,nope"), {})


def test_records_are_deterministic_and_valid_answers_are_recognized():
    assert structured_output.records(3) == structured_output.records(3)
    good = '{"name": "A", "age": 3, "city": "B", "email": "a@b.c", "status": "active", "tags": []}'
    assert structured_output.valid(good) and not structured_output.valid('{"name": "A"}')
