"""OpenAPI declarations shared by arl's two HTTP servers (the engine's SGLang routes and the proxy).

Both servers parse some bodies by hand (the engine's admin routes take SGLang's loose JSON, the proxy's
LLM routes skip FastAPI's request handling for speed), answer validation errors with 400 (never FastAPI's
422) and stream Server-Sent Events. FastAPI cannot see any of that, so the routes declare it with these
helpers and `publish` corrects the generated document: each hand-parsed body's model is added to the
components, and the 422 FastAPI adds to routes with parameters is removed (no route answers it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

STATUS_TEXT = {
    400: "Invalid request (the message names the field)",
    401: "No key, or an unknown key",
    403: "A key of the wrong kind, or one acting on another's session",
    404: "No such session, interaction or response",
    409: "The session still has calls in flight",
    410: "The session has ended",
    413: "The body is larger than the server accepts",
    421: "The session key belongs to another worker of the proxy's pool (proxy.workers)",
    429: "At capacity (sessions or capacity grants)",
    500: "A bug in the server",
    502: "An inference server behind this one failed",
    503: "Not ready, or no inference server can serve the call",
    "5XX": "The server or its inference backend failed",
}


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def json_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` of a route that reads its JSON body itself (the model must be `publish`ed)."""
    content = {"application/json": {"schema": ref(model)}}
    return {"requestBody": {"required": required, "content": content}}


def errors(model: type[BaseModel], *statuses: int | str) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` entries: each status answered with `model` as the JSON error body."""
    return {status: {"model": model, "description": STATUS_TEXT[status]} for status in statuses}


def sse_stream(event: dict[str, Any], *, done_marker: bool) -> dict[str, Any]:
    """The `text/event-stream` content of a streamed call: each event's `data` is JSON matching `event`.

    OpenAPI 3.1 describes one event with `schema` (the `data`/`event` fields as text) and the JSON inside
    `data` with `contentMediaType` + `contentSchema`. `done_marker`: the stream ends with `data: [DONE]`.
    """
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json", "contentSchema": event}
    if done_marker:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    schema = {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}
    return {"text/event-stream": {"schema": schema}}


def add_components(schema: dict[str, Any], models: Iterable[type[BaseModel]]) -> dict[str, Any]:
    """Put each model's JSON Schema (and its sub-models) in the document's components; returns them."""
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in js.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components[model.__name__] = js
    return components


def publish(
    app: FastAPI, models: Iterable[type[BaseModel]], *, edit: Callable[[dict[str, Any]], None] | None = None
) -> None:
    """Make `app.openapi()` the accurate document: `models` in the components, no 422s, then `edit`."""
    default = app.openapi
    extra = list(models)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = default()
        components = add_components(schema, extra)
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        if edit is not None:
            edit(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
