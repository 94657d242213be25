"""OpenAI's error shape, and the exceptions that become one.

Every error the server answers has the body ``{"error": {"message", "type", "param",
"code"}}``, in a response or as one server-sent event of a stream (``code`` a string).
``validation_error``, ``sampling_error`` and ``engine_error`` turn a pydantic
ValidationError, a SamplingParams ValueError and an engine failure into the
``APIError`` (``limits.py``) that carries it.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from specserve.engine.async_engine import EngineDeadError, RequestFailedError
from specserve.entrypoints.openai.limits import APIError


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | int | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    param = ""
    for part in err.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool") or "-" in part:
            break  # a union member's label ("list[int]") or a validator's: the path ends here
        else:
            param += f".{part}" if param else part
    param = param or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field (not part of the API, or not supported)"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code=err.get("type"))


_PARAM_NAMES = ("max_tokens", "min_tokens", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "stop", "logprobs", "n")


def sampling_error(e: ValueError) -> APIError:
    """A SamplingParams ValueError as a 400 naming the field its message starts with."""
    message = str(e).removeprefix("invalid SamplingParams: ")
    param = next((n for n in _PARAM_NAMES if message.startswith(n + " ")), None)
    return APIError(400, message, param=param, code="invalid_value")


def engine_error(e: Exception) -> APIError:
    """The one error shape of an engine failure, in a body or in a stream."""
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", code="engine_dead")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), "server_error", code="request_failed")
    return APIError(500, str(e), "server_error", code="engine_error")
