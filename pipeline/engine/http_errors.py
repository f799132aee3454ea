"""Request parsing and error bodies shared by the engine's HTTP servers: bad input is a 400 that says why."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class BadRequest(Exception):
    """Answered with HTTP 400; `admin` endpoints use SGLang's `{"success": false, "message"}` body."""

    def __init__(self, message: str, *, admin: bool = False) -> None:
        super().__init__(message)
        self.admin = admin


async def parse_body(request: Any, model: type[M], *, admin: bool = False, allow_empty: bool = False) -> M:
    """The request body as `model`, or a `BadRequest` naming every problem."""
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return model()
        raise BadRequest(f"empty body: send a JSON object for {model.__name__}", admin=admin)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}", admin=admin) from None
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a JSON object, got {type(data).__name__}", admin=admin)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise BadRequest(f"invalid {model.__name__}: {problems}", admin=admin) from None


def error_response(message: str, status: int, *, admin: bool = False) -> Any:
    from fastapi.responses import JSONResponse

    if admin:
        return JSONResponse({"success": False, "message": message}, status_code=status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
