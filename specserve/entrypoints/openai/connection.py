"""Slow and oversized request heads: uvicorn's h11 protocol with a deadline and a size cap.

What uvicorn 0.54 offers, measured: ``timeout_keep_alive`` closes a connection
idle *after* a response; a connection that sends nothing, half a request line
or half its headers is never timed out (still open after minutes), so a few
thousand slow clients hold a few thousand sockets. ``h11_max_incomplete_event_size``
caps only a head that is still incomplete (uvicorn then answers 400); a head
over the cap that arrives in one read passes. So:

* the head (request line and header fields) must be complete within
  ``ServerLimits.header_timeout_s`` of the connection opening, or of the first
  byte of the next request on a kept-alive one, else 408 and the connection closes;
* a head larger than ``ServerLimits.max_header_bytes`` gets 431 and the
  connection closes, whether it arrived in pieces or at once.

``uvicorn_config`` builds the ``uvicorn.Config`` that ``specserve serve`` and
the tests use; it always picks this h11 protocol (httptools, if installed,
would not have these limits). ``tls_options`` checks ``serve``'s TLS files (vLLM's
``--ssl-*`` flags) before the model loads and turns them into uvicorn's settings.
"""
from __future__ import annotations

import asyncio
import os
import ssl

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.entrypoints.openai.limits import ServerLimits


class _HeadCappedConnection(h11.Connection):
    """An h11 connection that rejects a complete request head over the cap, as h11
    itself rejects an incomplete one, and remembers the error it raised."""

    def __init__(self, max_head_bytes: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and head_size(event) > self.max_head_bytes:
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        except h11.RemoteProtocolError as e:
            self.error = e
            raise
        return event


def head_size(request: h11.Request) -> int:
    """Bytes of the request line and header fields as parsed (about what was sent)."""
    line = len(request.method) + len(request.target) + len(request.http_version) + 9
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


class LimitedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` plus the header deadline and size cap (module docstring)."""

    limits: ServerLimits = ServerLimits()   # replaced by the subclass ``uvicorn_config`` makes

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _HeadCappedConnection(self.limits.max_header_bytes)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:       # the first bytes of a request on a kept-alive connection
            self._arm_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:   # the head is complete (or was rejected)
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:   # part of a pipelined head
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers every parse error 400; an over-large head is 431."""
        if self.conn.error is not None and self.conn.error.error_status_hint == 431:
            self._reject(431, "Request Header Fields Too Large",
                         f"the request line and headers are larger than {self.limits.max_header_bytes} bytes")
        else:
            super().send_400_response(msg)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._reject(408, "Request Timeout",
                         f"the request line and headers did not arrive within {self.limits.header_timeout_s:g} s")

    def _reject(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` and close, bypassing h11 (before a complete request it has nothing to answer)."""
        body = message.encode()
        self.transport.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        self.transport.close()


def uvicorn_config(app, limits: ServerLimits | None = None, **kwargs) -> uvicorn.Config:
    """The ``uvicorn.Config`` serving ``app`` with ``limits`` (default: the app's, from ``build_app``)."""
    limits = limits or getattr(getattr(app, "state", None), "limits", None) or ServerLimits.from_env()
    protocol = type("SpecserveH11Protocol", (LimitedH11Protocol,), {"limits": limits})
    kwargs.setdefault("timeout_keep_alive", 30)
    return uvicorn.Config(app, http=protocol, **kwargs)


# --ssl-cert-reqs: Python's ssl.VerifyMode values, as vLLM and uvicorn take them
CERT_REQS = {0: "none", 1: "optional", 2: "required"}


def tls_options(keyfile: str | None, certfile: str | None, ca_certs: str | None = None,
                cert_reqs: int = ssl.CERT_NONE) -> dict:
    """uvicorn's ``ssl_*`` settings for HTTPS with this key and certificate (``{}``: plain HTTP).

    Checked here, so a missing file or a key that does not match its certificate is a clear
    ValueError before the model loads (uvicorn would fail only once it starts).
    ``ca_certs`` and ``cert_reqs`` (1 optional, 2 required) ask clients for certificates signed
    by those authorities (mutual TLS)."""
    if keyfile is None and certfile is None:
        if ca_certs is not None or cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
        return {}
    if keyfile is None or certfile is None:
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}")
    if cert_reqs != ssl.CERT_NONE and ca_certs is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs: the authorities client certificates must come from")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
        if ca_certs is not None:
            context.load_verify_locations(ca_certs)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"the TLS files cannot be used ({certfile}, {keyfile}"
                         f"{', ' + ca_certs if ca_certs else ''}): {e}") from None
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile, "ssl_ca_certs": ca_certs, "ssl_cert_reqs": cert_reqs}
