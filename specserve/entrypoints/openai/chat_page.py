"""The chat page that ``specserve serve`` shows at ``/``.

Why it exists: speculative decoding is invisible in an API response, so this
page makes it visible. It is a plain HTML/CSS/JavaScript client of the public
API only (no build step, nothing fetched from elsewhere): it streams
``POST /v1/chat/completions`` with ``"specserve": {"provenance": true}``,
colours each token of the answer by its source (accepted draft, recovered,
bonus, plain), shows live tokens/s and acceptance figures (replaced by the
server's ``stats`` when the answer ends) and the server's configuration from
``GET /v1/specserve/info``.

Routes: ``GET /`` (the page) and ``GET /static/{name}`` for the shipped files
only (anything else is a 404). Neither is under ``/v1``, so an API key does not
guard them; the page sends the key the user types with its ``/v1`` calls.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response

STATIC_DIR = Path(__file__).with_name("static")

# The shipped files and their media types: nothing else is served.
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}

# Only this origin: the page loads nothing from elsewhere and talks only to its own server.
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
}


def _file(name: str) -> Response:
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise HTTPException(status_code=404, detail=f"no static file {name!r}")
    return Response((STATIC_DIR / name).read_bytes(), media_type=media_type, headers=_HEADERS)


def add_chat_page(app: FastAPI) -> None:
    """Register ``GET /`` (the chat page) and ``GET /static/{name}`` on ``app``."""

    @app.get("/", include_in_schema=False)
    def chat_page() -> Response:
        return _file("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    def chat_static(name: str) -> Response:
        return _file(name)
