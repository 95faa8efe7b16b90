"""The one place a failure becomes an HTTP status and an OpenAI error body (imports no jax).

In: an exception raised while serving a request: the server's own `ApiError` (401 key, 404
model, 413 size, 503 queue), a pydantic `ValidationError` (400, `param` the first field at
fault), the engine's `RequestError` (400, `param` its field), `RequestFailed` (500) or
anything else (500). Out: `(status, body, headers)`, the body OpenAI's
`{"error": {"message", "type", "param", "code"}}`. Nothing here reads a message to decide.
"""
from __future__ import annotations

import dataclasses

from pydantic import ValidationError

from hetero_jax.outputs import RequestError, RequestFailed

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
         503: "service_unavailable_error"}


@dataclasses.dataclass
class ApiError(Exception):
    """A request the server itself refuses (not the engine)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict = dataclasses.field(default_factory=dict)


def _where(loc: tuple) -> str:
    """A pydantic error location -> "messages.0.content" (for the message; `param` is the
    top-level field)."""
    return ".".join(str(part) for part in loc)


def as_api_error(error: Exception) -> ApiError:
    """The status and parts of the answer to `error`."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ValidationError):
        first = error.errors(include_url=False)[0]
        loc = first["loc"]
        value = repr(first.get("input"))
        value = value if len(value) <= 80 else value[:77] + "..."
        where = f"{_where(loc)}: " if loc else ""
        return ApiError(400, f"{where}{first['msg']} (got {value})",
                        str(loc[0]) if loc else None, first["type"])
    if isinstance(error, RequestError):
        return ApiError(400, str(error), error.field, "invalid_value")
    if isinstance(error, RequestFailed):
        return ApiError(500, f"the engine failed this request: {error.reason}", None,
                        "request_failed")
    return ApiError(500, f"internal error: {type(error).__name__}", None, "internal_error")


def error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": TYPES.get(error.status, "error"),
                      "param": error.param, "code": error.code}}
