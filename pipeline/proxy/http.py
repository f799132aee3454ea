"""HTTP plumbing of the proxy: JSON responses, the body-size limit, error handlers.

Every failure leaves as a 4xx (or a 502/503 when an inference server fails) in the API's own
error shape: FastAPI's 422 validation errors become 400s, unknown routes 404s, wrong methods
405s, bodies over `proxy.max_request_bytes` 413s before they are read whole.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.net.apidoc import add_components
from pipeline.proxy.errors import ApiError, format_validation_errors

log = logging.getLogger("arl.proxy.http")

ANTHROPIC_PATHS = ("/v1/messages",)


M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """Validate the raw body with pydantic's own JSON parser (one pass, no `json.loads` + re-walk).

    Used on the LLM routes, the hot path; their schemas are still published in the OpenAPI
    document by `add_raw_posts`. Errors read like FastAPI's, as a 400 in the route's shape.
    """
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            reason = (detail.get("ctx") or {}).get("error", "parse error")
            raise ApiError(400, f"the request body is not valid JSON: {reason}") from None
        if any(not e.get("loc") for e in errors):
            raise ApiError(
                400, "the request body must be a JSON object (send it with Content-Type: application/json)"
            ) from None
        message, param = format_validation_errors([dict(e) for e in errors])
        raise ApiError(400, message, param=param) from None


@dataclass(frozen=True)
class RawPost:
    """A POST route that parses its own body (`parse_body`) and takes nothing else from FastAPI."""

    path: str
    endpoint: Callable[[Request], Awaitable[Response]]
    body: type[BaseModel]
    responses: dict[str, Any] = field(default_factory=dict)
    """OpenAPI response objects by status; the models their schemas refer to are in `models`."""
    models: tuple[type[BaseModel], ...] = ()


def add_raw_posts(app: FastAPI, routes: list[RawPost]) -> None:
    """Serve `routes` as plain Starlette routes, documented in the OpenAPI schema as FastAPI would.

    For the LLM routes, the hot path: FastAPI's per-request handling (dependency solving, body
    sniffing, endpoint context) cost more CPU than they need. Errors still go through the app's
    exception handlers, a wrong method is still a 405.
    """
    # First in the route table: the router tries routes in order, and these take nearly every request.
    app.router.routes[:0] = [Route(r.path, r.endpoint, methods=["POST"], include_in_schema=False) for r in routes]
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = default()
        paths = schema.setdefault("paths", {})
        for route in routes:
            add_components(schema, (route.body, *route.models))
            paths[route.path] = {"post": _operation(route)}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _operation(route: RawPost) -> dict[str, Any]:
    name = route.endpoint.__name__
    path_id = re.sub(r"\W", "_", route.path)
    ref = {"$ref": f"#/components/schemas/{route.body.__name__}"}
    return {
        "summary": name.replace("_", " ").title(),
        "operationId": f"{name}{path_id}_post",
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
        "responses": route.responses,
    }


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def json_response(obj: Any, status: int = 200) -> Response:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(content=body, status_code=status, media_type="application/json")


def error_response(path: str, err: ApiError) -> Response:
    body = err.anthropic_body() if is_anthropic(path) else err.openai_body()
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    response = json_response(body, err.status)
    if headers:
        response.headers.update(headers)
    return response


class BodyLimit:
    """Pure ASGI middleware: 413 when Content-Length, or the bytes actually received, pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    size = int(value)
                except ValueError:
                    await send_error(path, send, ApiError(400, "invalid Content-Length header"))
                    return
                if size > self.max_bytes:
                    await send_error(path, send, self._too_large(size))
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(received)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge as exc:
            if not started:
                await send_error(path, send, self._too_large(exc.size))

    def _too_large(self, size: int) -> ApiError:
        return ApiError(
            413,
            f"request body is {size} bytes, more than the proxy accepts "
            f"({self.max_bytes} bytes, proxy.max_request_bytes)",
        )


async def send_error(path: str, send: Send, err: ApiError) -> None:
    """Answer `err` straight from an ASGI middleware, in the same shape as the app's error handlers."""
    response = error_response(path, err)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()],
        }
    )
    await send({"type": "http.response.body", "body": response.body})


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, ApiError], None] | None = None) -> None:
    """Every error in its API's shape; `on_error` sees each one a route or body check answered (not a key check)."""

    def answer(request: Request, err: ApiError) -> Response:
        if on_error is not None:
            on_error(request, err)
        return error_response(request.url.path, err)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            ctx = detail.get("ctx") or {}
            err = ApiError(400, f"the request body is not valid JSON: {ctx.get('error', 'parse error')}")
        elif any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            err = ApiError(400, "the request body must be a JSON object (send it with Content-Type: application/json)")
        else:
            message, param = format_validation_errors(errors)
            err = ApiError(400, message, param=param)
        return answer(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"no endpoint {request.method} {request.url.path} (see docs/proxy.md for the endpoints)"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        response = error_response(request.url.path, ApiError(exc.status_code, message))
        response.headers.update(exc.headers or {})  # a 405's `Allow` (RFC 9110: the methods the path serves)
        return response

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # The caller hung up before its request was read (an agent cancelled, or its HTTP pool closed the
        # connection): nothing was done for it and nobody reads an answer. Not a bug, so no traceback.
        log.warning("%s %s: the client hung up before its request was read", request.method, request.url.path)
        return error_response(request.url.path, ApiError(400, "the client disconnected before its request was read"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # A bug, not bad input: log it with the traceback (no headers, so no keys), answer a clean 500.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, ApiError(500, f"internal proxy error: {type(exc).__name__}"))
