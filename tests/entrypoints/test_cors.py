"""Cross-origin access (``CORSOptions``; vLLM's --allowed-origins): none by default, the named
origins' pages when asked, preflights answered without the API key, and the CORS headers on
errors and streams too. Tiny random model."""
from __future__ import annotations

import pytest

from specserve import LLM
from specserve.entrypoints.cli import build_parser
from specserve.entrypoints.openai.api_server import CORSOptions, build_app

from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

APP_ORIGIN = "http://app.example"
BODY = {"prompt": [300, 301, 302], "max_tokens": 2, "temperature": 0}
PREFLIGHT = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type, authorization"}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)


def preflight(url, origin=APP_ORIGIN):
    with local_http.Client() as c:
        return c.options(f"{url}/v1/completions", headers={**PREFLIGHT, "Origin": origin}, timeout=30)


def post(url, headers=None, **extra):
    return local_http.post(f"{url}/v1/completions", json={**BODY, **extra}, timeout=60,
                           headers={"Origin": APP_ORIGIN, **(headers or {})})


def test_no_origin_is_allowed_by_default(llm):
    with running_server(build_app(llm, "tiny")) as url:
        assert "access-control-allow-origin" not in preflight(url).headers
        r = post(url)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_named_origins_get_preflights_answers_and_streams(llm):
    with running_server(build_app(llm, "tiny", cors=CORSOptions([APP_ORIGIN]))) as url:
        r = preflight(url)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        r = post(url)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
        with local_http.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True},
                               headers={"Origin": APP_ORIGIN}, timeout=60) as s:
            assert s.headers["access-control-allow-origin"] == APP_ORIGIN
            assert "[DONE]" in s.read().decode()
        other = preflight(url, "http://elsewhere.example")
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_with_an_api_key_the_preflight_needs_none_and_a_401_carries_the_headers(llm):
    app = build_app(llm, "tiny", api_key="secret", cors=CORSOptions(["*"]))
    with running_server(app) as url:
        assert preflight(url).status_code == 200
        refused = post(url)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
        assert post(url, {"Authorization": "Bearer secret"}).status_code == 200


def test_credentials_need_named_origins():
    with pytest.raises(ValueError, match="wildcard"):
        CORSOptions(["*"], allow_credentials=True)
    assert CORSOptions([APP_ORIGIN], allow_credentials=True).allow_credentials


def test_the_flags_take_json_lists_as_vllms_do(capsys):
    args = build_parser().parse_args(["serve", "--allowed-origins", f'["{APP_ORIGIN}"]', "--allowed-methods",
                                      '["GET", "POST"]'])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers) == ([APP_ORIGIN], ["GET", "POST"], ["*"])
    assert build_parser().parse_args(["serve"]).allowed_origins == []
    for text, message in ((APP_ORIGIN, "not JSON"), (f'"{APP_ORIGIN}"', "a JSON list of strings is needed")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--allowed-origins", text])
        assert message in capsys.readouterr().err
