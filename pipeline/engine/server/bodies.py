"""The engine app's bodies: a JSON request body parsed into its model (a `RequestError` naming every problem),
and the two error-body shapes (`/generate`'s OpenAI-style one, the admin routes' SGLang one)."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from pipeline.engine.server.requests import RequestError

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M], *, allow_empty: bool = False) -> M:
    """The request body as `model`, or a `RequestError` naming every problem."""
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return model()
        raise RequestError(f"empty body: send a JSON object for {model.__name__}")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(f"body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise RequestError(f"invalid {model.__name__}: {problems}") from None


def parse_version(value: str | int | None) -> int | None:
    """A weight update's `weight_version` (SGLang sends a string) as arl's integer version; None: keep it."""
    if value is None:
        return None
    try:
        version = int(value)
    except (TypeError, ValueError):
        raise RequestError(f"weight_version must be a non-negative integer (arl's versions), got {value!r}") from None
    if version < 0:
        raise RequestError(f"weight_version must be >= 0, got {version}")
    return version


def error_response(message: str, status: int, *, admin: bool = False) -> JSONResponse:
    if admin:
        return JSONResponse({"success": False, "message": message}, status_code=status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
