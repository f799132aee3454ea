"""Errors the proxy answers with, rendered in each API's own error shape.

Handlers raise `ApiError(status, message, param=...)`; the app turns it into
`{"error": {"message", "type", "param", "code"}}` for the OpenAI routes and
`{"type": "error", "error": {"type", "message"}}` for the Anthropic route (`/v1/messages`), so
an SDK raises its usual exception class with our message in it. Messages say what was wrong and
how to fix it; they never contain a key.
"""

from __future__ import annotations

from typing import Any

# Status -> (OpenAI error type, Anthropic error type), as the two vendors name them.
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    409: ("invalid_request_error", "invalid_request_error"),
    410: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    502: ("api_error", "api_error"),
    503: ("api_error", "overloaded_error"),
    504: ("api_error", "api_error"),
}


class ApiError(Exception):
    """An HTTP error for the client: status, a message for a person, and OpenAI's optional fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, ("invalid_request_error", "invalid_request_error"))[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, ("invalid_request_error", "invalid_request_error"))[1]
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def format_validation_errors(errors: list[dict[str, Any]], limit: int = 5) -> tuple[str, str | None]:
    """Pydantic/FastAPI validation errors as one readable line, and the first offending parameter.

    The raw input is left out on purpose: it may be huge, and for auth-less bodies it is the
    user's own data echoed back for no benefit.
    """
    parts = []
    first_param: str | None = None
    for err in errors[:limit]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        where = ".".join(loc) or "body"
        if first_param is None and loc:
            first_param = loc[0]
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    more = f" (and {len(errors) - limit} more)" if len(errors) > limit else ""
    return "invalid request: " + "; ".join(parts) + more, first_param
