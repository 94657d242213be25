"""``ServerLimits`` from its defaults, ``SPECSERVE_*`` variables and ``specserve serve`` flags
(parsing only: no model, no server)."""
from __future__ import annotations

import dataclasses

import pytest

from specserve.entrypoints.cli import build_parser
from specserve.entrypoints.openai.limits import OPTIONS, ServerLimits


def limits_from(argv: list[str]) -> ServerLimits:
    args = build_parser().parse_args(["serve", *argv])
    return ServerLimits.from_env(**{o.field: getattr(args, o.field) for o in OPTIONS})


@pytest.fixture(autouse=True)
def no_limit_env(monkeypatch):
    for o in OPTIONS:
        monkeypatch.delenv(o.env, raising=False)


def test_every_field_has_one_env_variable_and_one_flag():
    fields = [f.name for f in dataclasses.fields(ServerLimits)]
    assert sorted(o.field for o in OPTIONS) == sorted(fields)
    assert len({o.env for o in OPTIONS}) == len({o.flag for o in OPTIONS}) == len(fields)


def test_no_flags_no_env_gives_the_defaults():
    assert limits_from([]) == ServerLimits()
    assert ServerLimits().header_timeout_s == 10.0 and ServerLimits().max_header_bytes == 64 << 10


def test_flags_set_every_field():
    limits = limits_from(["--max-body-bytes", "1000", "--body-timeout", "2.5", "--header-timeout", "0.5",
                          "--max-header-bytes", "8192", "--max-json-depth", "4", "--max-prompts", "3"])
    assert limits == ServerLimits(max_body_bytes=1000, body_timeout_s=2.5, header_timeout_s=0.5,
                                  max_header_bytes=8192, max_json_depth=4, max_prompts=3)


def test_env_variables_apply_and_flags_override_them(monkeypatch):
    monkeypatch.setenv("SPECSERVE_HEADER_TIMEOUT_S", "3")
    monkeypatch.setenv("SPECSERVE_MAX_HEADER_BYTES", "4096")
    assert limits_from([]) == ServerLimits(header_timeout_s=3.0, max_header_bytes=4096)
    assert limits_from(["--max-header-bytes", "2048"]).max_header_bytes == 2048


@pytest.mark.parametrize("flag,value", [
    ("--max-body-bytes", "0"), ("--max-body-bytes", "-1"), ("--max-body-bytes", "1.5"), ("--max-body-bytes", "lots"),
    ("--body-timeout", "0"), ("--body-timeout", "nan"), ("--body-timeout", "inf"), ("--header-timeout", "-2"),
    ("--max-header-bytes", "64k"), ("--max-json-depth", "0"), ("--max-prompts", ""),
])
def test_an_invalid_flag_is_a_clear_argparse_error(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a positive" in err and repr(value) in err, err


def test_an_invalid_env_variable_names_the_variable(monkeypatch):
    monkeypatch.setenv("SPECSERVE_MAX_PROMPTS", "many")
    with pytest.raises(ValueError, match=r"\$SPECSERVE_MAX_PROMPTS must be a positive integer, got 'many'"):
        ServerLimits.from_env()


@pytest.mark.parametrize("field,value", [("max_header_bytes", 0), ("header_timeout_s", float("nan")),
                                         ("max_prompts", True), ("max_body_bytes", 1.5)])
def test_invalid_values_in_code_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: value})
