"""``specserve serve``'s start-up (``openai/serve.py``): the capacity line it logs, and refusals
before the model loads."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve.entrypoints.cli import main
from specserve.entrypoints.openai.serve import capacity_line


def test_the_capacity_line_counts_tokens_and_full_length_requests():
    engine = SimpleNamespace(kv_cache=SimpleNamespace(num_blocks=100, block_size=16), max_model_len=512,
                             config=SimpleNamespace(max_num_seqs=8))
    line = capacity_line(engine)
    assert "100 blocks of 16 tokens = 1,600 tokens" in line and "3.1 requests of max_model_len 512" in line
    assert "--max-num-seqs 8" in line


@pytest.mark.parametrize("flags, message", [
    (["--max-stored-responses", "-1"], "--max-stored-responses must be >= 0"),
    (["--allowed-origins", '["*"]', "--allow-credentials"], "allow_credentials needs the origins named"),
])
def test_bad_server_flags_stop_before_the_model_loads(monkeypatch, capsys, flags, message):
    import specserve.entrypoints.openai.serve as serve

    monkeypatch.setattr(serve, "build_llm", lambda args: pytest.fail("the model was loaded"))
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
