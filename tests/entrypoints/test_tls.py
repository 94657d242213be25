"""HTTPS (``connection.tls_options``; vLLM's --ssl-* flags): the server answers over TLS with the
given key and certificate, asks for client certificates when told (mutual TLS), and bad TLS
files are a clear error before the model loads. Certificates from trustme; tiny random model."""
from __future__ import annotations

import ssl

import httpx
import pytest
import trustme

from specserve import LLM
from specserve.entrypoints.cli import main
from specserve.entrypoints.openai.api_server import build_app
from specserve.entrypoints.openai.connection import tls_options

from server_util import running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BODY = {"prompt": [300, 301, 302], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def server_files(ca, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1", "localhost")
    key, chain, authority = folder / "key.pem", folder / "cert.pem", folder / "ca.pem"
    cert.private_key_pem.write_to_path(str(key))
    cert.cert_chain_pems[0].write_to_path(str(chain))
    ca.cert_pem.write_to_path(str(authority))
    return {"key": str(key), "cert": str(chain), "ca": str(authority)}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)


def test_the_server_answers_over_https_with_its_certificate(llm, server_files):
    tls = tls_options(server_files["key"], server_files["cert"])
    with running_server(build_app(llm, "tiny"), **tls) as url:
        assert url.startswith("https://")
        trusting = ssl.create_default_context(cafile=server_files["ca"])
        r = httpx.post(f"{url}/v1/completions", json=BODY, verify=trusting, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.ConnectError):          # a client that does not trust the certificate
            httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        with pytest.raises(httpx.HTTPError):             # plain HTTP on the HTTPS port
            httpx.post(url.replace("https://", "http://") + "/v1/completions", json=BODY, timeout=60)


def test_required_client_certificates(llm, ca, server_files, tmp_path):
    tls = tls_options(server_files["key"], server_files["cert"], server_files["ca"], ssl.CERT_REQUIRED)
    client = ca.issue_cert("client@example")
    client_pem = tmp_path / "client.pem"
    client.private_key_and_cert_chain_pem.write_to_path(str(client_pem))
    with running_server(build_app(llm, "tiny"), **tls) as url:
        with_cert = ssl.create_default_context(cafile=server_files["ca"])
        with_cert.load_cert_chain(str(client_pem))
        assert httpx.post(f"{url}/v1/completions", json=BODY, verify=with_cert, timeout=60).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"{url}/v1/completions", json=BODY, timeout=60,
                       verify=ssl.create_default_context(cafile=server_files["ca"]))


def test_no_files_is_plain_http():
    assert tls_options(None, None) == {}


def test_bad_tls_files_are_clear_errors(server_files, tmp_path):
    other = trustme.CA().issue_cert("127.0.0.1")
    other_key = tmp_path / "other-key.pem"
    other.private_key_pem.write_to_path(str(other_key))
    cases = [((server_files["key"], None), "needs both"),
             ((server_files["key"], str(tmp_path / "missing.pem")), "no such file"),
             ((str(other_key), server_files["cert"]), "cannot be used"),          # a key of another certificate
             ((server_files["key"], server_files["cert"], None, 2), "needs --ssl-ca-certs"),
             ((None, None, server_files["ca"]), "need --ssl-keyfile")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            tls_options(*args)


def test_serve_refuses_bad_tls_files_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import specserve.entrypoints.openai.serve as serve

    monkeypatch.setattr(serve, "build_llm", lambda args: pytest.fail("the model was loaded"))
    assert main(["serve", "--ssl-keyfile", str(tmp_path / "nope.pem"), "--ssl-certfile", str(tmp_path / "x.pem")]) == 2
    assert "--ssl-keyfile" in capsys.readouterr().err
