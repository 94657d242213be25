"""What the server accepts before a request reaches the engine: body size, read
time, media type, JSON shape (docs/serving.md lists every limit and its status).

``read_json`` turns an HTTP request into a checked JSON object or an ``APIError``:
415 unless ``Content-Type: application/json`` (a web page cannot then post to a
keyless server without a CORS preflight), 413 for a body over the size limit
(from ``Content-Length`` at once, or as soon as a chunked body passes it), 408
when the body takes too long to arrive, 400 for invalid JSON, ``NaN`` or
``Infinity`` (JSON has neither; Python's parser accepts them), numbers that
overflow to infinity, nesting deeper than the limit, and strings with lone
surrogates (``"\\ud800"``: valid JSON escapes, but no UTF-8 exists for them, so
the tokenizer and the response encoder would fail on them).
A client that disconnects mid-upload raises ``ClientGone``: nobody to answer.
The request head (its deadline and size cap) is checked before any of this,
in ``connection.py``.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:   # the server's modules import starlette; the command line's options (OPTIONS) need not
    from starlette.requests import Request


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def with_names(e: APIError, names: dict[str, str]) -> APIError:
    """``e`` naming the fields as the client sent them: an API that is rewritten as another
    (``names``: the rewritten request's field -> the client's) reports its own fields."""
    for inner, outer in names.items():
        if e.param == inner or (e.param or "").startswith(inner + "[") or (e.param or "").startswith(inner + "."):
            e.param = outer + e.param[len(inner):] if e.param != inner else outer
            if e.message.startswith(inner):
                e.message = outer + e.message[len(inner):]
            break
    return e


class ClientGone(Exception):
    """The client went away before its request was read: answer nobody, log nothing."""


def positive_int(text: str) -> int:
    """``text`` as an integer >= 1 (for environment variables and CLI flags)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """``text`` as a finite number > 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive number of seconds, got {text!r}")
    return value


@dataclass
class ServerLimits:
    """Per-request limits of the HTTP server (docs/serving.md: "Serving limits and errors").

    Each field has an environment variable and a ``specserve serve`` flag (``OPTIONS``).
    """

    max_body_bytes: int = 4 << 20        # 413 beyond
    body_timeout_s: float = 30.0         # 408 when the whole body has not arrived by then
    header_timeout_s: float = 10.0       # 408 + close when the request head has not (connection.py)
    max_header_bytes: int = 64 << 10     # 431 + close beyond: request line and headers (connection.py)
    max_json_depth: int = 32             # 400 beyond (objects and arrays nested)
    max_prompts: int = 64                # 400: prompts in one /v1/completions batch
    max_structured_output_bytes: int = 64 << 10   # 400 beyond: a JSON schema, regex, grammar or tools' constraint

    @classmethod
    def from_env(cls, **overrides) -> "ServerLimits":
        """The defaults, then ``SPECSERVE_*`` variables, then ``overrides`` that are not None."""
        values = {}
        for o in OPTIONS:
            if overrides.get(o.field) is not None:
                values[o.field] = overrides[o.field]
            elif os.environ.get(o.env):
                try:
                    values[o.field] = o.parse(os.environ[o.env])
                except ValueError as e:
                    raise ValueError(f"${o.env} {e}") from None
        return cls(**values)

    def __post_init__(self) -> None:
        for o in OPTIONS:
            value = getattr(self, o.field)
            kind = int if o.parse is positive_int else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not (math.isfinite(value) and value > 0):
                what = "a positive integer" if kind is int else "a positive number of seconds"
                raise ValueError(f"{o.field} must be {what}, got {value!r}")


class LimitOption(NamedTuple):
    field: str                      # of ServerLimits
    env: str                        # environment variable
    flag: str                       # ``specserve serve`` flag
    parse: Callable[[str], float]   # text -> value, ValueError when invalid
    help: str


OPTIONS = [
    LimitOption("max_body_bytes", "SPECSERVE_MAX_BODY_BYTES", "--max-body-bytes", positive_int,
                "largest request body in bytes (413 beyond)"),
    LimitOption("body_timeout_s", "SPECSERVE_BODY_TIMEOUT_S", "--body-timeout", positive_float,
                "seconds for the whole request body to arrive (408 after)"),
    LimitOption("header_timeout_s", "SPECSERVE_HEADER_TIMEOUT_S", "--header-timeout", positive_float,
                "seconds for the request line and headers to arrive (408 and close after)"),
    LimitOption("max_header_bytes", "SPECSERVE_MAX_HEADER_BYTES", "--max-header-bytes", positive_int,
                "largest request line plus headers in bytes (431 and close beyond)"),
    LimitOption("max_json_depth", "SPECSERVE_MAX_JSON_DEPTH", "--max-json-depth", positive_int,
                "deepest nesting of JSON objects and arrays (400 beyond)"),
    LimitOption("max_prompts", "SPECSERVE_MAX_PROMPTS", "--max-prompts", positive_int,
                "most prompts in one /v1/completions request (400 beyond)"),
    LimitOption("max_structured_output_bytes", "SPECSERVE_MAX_STRUCTURED_OUTPUT_BYTES", "--max-structured-output-bytes",
                positive_int, "largest JSON schema, regex or grammar of a request, in bytes (400 beyond)"),
]


async def read_json(raw: Request, limits: ServerLimits, kinds: tuple[type, ...] = (dict,)) -> dict:
    """The request's body as a checked JSON object (see the module docstring); ``kinds``: what the
    top level may be (llama-server's POST /lora-adapters takes an array too)."""
    from starlette.requests import ClientDisconnect

    media_type = raw.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' "
                            f"(got {media_type or 'no content type'!r})", code="unsupported_media_type")
    length = raw.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, f"invalid Content-Length {length!r}", code="invalid_request")
        if int(length) > limits.max_body_bytes:
            raise _too_large(limits.max_body_bytes)
    try:
        body = await asyncio.wait_for(_read_body(raw, limits.max_body_bytes), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {limits.max_json_depth} levels",
                       code="invalid_json") from None
    if not isinstance(data, kinds):
        raise APIError(400, "the request body must be a JSON " + (" or ".join("object" if k is dict else "array"
                                                                             for k in kinds)), code="invalid_json")
    check_json(data, limits.max_json_depth)
    return data


async def _read_body(raw: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_json(data, max_depth: int) -> None:
    """400 for nesting deeper than ``max_depth``, lone surrogates, non-finite numbers.

    Iterative (an explicit stack), so the check itself cannot hit Python's recursion limit.
    """
    stack = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise APIError(400, f"the request body nests deeper than {max_depth} levels",
                               param=path or None, code="invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path)
                    child = f"{path}.{key}" if path else key
                else:
                    child = f"{path}[{key}]"
                stack.append((item, depth + 1, child))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, f"{path}: numbers must be finite", param=path or None, code="invalid_json")


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"{path}: " if path else ""
        raise APIError(400, f"{where}the text holds a lone surrogate {text[e.start]!r} at index {e.start}, "
                            "which is not valid Unicode", param=path or None, code="invalid_unicode") from None
