"""A real uvicorn server on a free loopback port, for the server tests, configured
as ``specserve serve`` configures it (``uvicorn_config``: the header limits)."""
from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time

import httpx
import uvicorn

from specserve.entrypoints.openai.connection import uvicorn_config


class local_http:
    """httpx for the plain-http loopback servers of these tests, without loading a CA bundle:
    httpx builds one per client (~30 ms), and these modules make hundreds of calls."""

    post = staticmethod(functools.partial(httpx.post, verify=False))
    get = staticmethod(functools.partial(httpx.get, verify=False))
    delete = staticmethod(functools.partial(httpx.delete, verify=False))
    stream = staticmethod(functools.partial(httpx.stream, verify=False))
    Client = staticmethod(functools.partial(httpx.Client, verify=False))


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@contextlib.contextmanager
def running_server(app, **config):
    """Yield the base URL of ``app`` served by uvicorn in a background thread (``config``: more of
    uvicorn's settings, such as ``connection.tls_options``'s: then the URL is https)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    scheme = "https" if config.get("ssl_certfile") else "http"
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="off", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=30), "uvicorn did not start"
    try:
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
