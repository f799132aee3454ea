"""The engine's HTTP app: SGLang's native protocol over any `EngineBackend` (the one route table).

Every route of docs/inference.md is here, once, for every backend: `/health`, `/health_generate`,
`/generate` (one answer, or Server-Sent Events), `/model_info`, `/server_info` (and SGLang's
deprecated aliases `/get_model_info`, `/get_server_info`), `/flush_cache`, `/abort_request`,
`/pause_generation`, `/continue_generation`, `/update_weights_from_disk`, `/init_weights_update_group`,
`/begin_weight_update`, `/update_weights_from_distributed`, `/end_weight_update`,
`/destroy_weights_update_group`, `/get_weights_by_name`, `/load_lora_adapter`, `/unload_lora_adapter`,
`/update_weight_version`. Every path is one SGLang 0.5.23 serves, with
its meaning.

Weight-update sessions are SGLang's: `/update_weights_from_distributed` is refused (400, before anything
is received) unless `/begin_weight_update` opened a session that `/end_weight_update` has not closed yet,
so a publisher that would hang against SGLang fails against arl's servers too.

Every body is parsed here; input the server cannot serve is a 400 that names the problem, in
`{"error": {"message", "type", "code"}}` on `/generate` and SGLang's `{"success": false, "message"}`
on the admin routes; never a 5xx.

`GET /openapi.json` describes all of it truthfully: the hand-parsed bodies' models (`apidoc.json_body`),
each answer's model (`schemas/engine_answers.py`), every status with its body, the event stream; the fuzz
suite checks the running server against it.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel

from pipeline.engine.server.backend import EngineBackend
from pipeline.engine.server.bodies import M, error_response, parse_body, parse_version
from pipeline.engine.server.completions import complete, events, until_disconnect
from pipeline.engine.server.requests import RequestError, expand
from pipeline.net.addresses import PeerLog
from pipeline.net.apidoc import errors, json_body, publish, sse_stream
from schemas.engine_answers import (
    AdminAnswer,
    EngineError,
    GenerateResponse,
    LoraAnswer,
    ModelInfo,
    ServerInfo,
    WeightRows,
)
from schemas.engine_api import (
    AbortReq,
    BeginWeightUpdateReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    GenerateReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    PauseGenerationReqInput,
    SamplingParams,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightVersionReqInput,
)

log = logging.getLogger("arl.engine.app")
_GENERATE = "/generate"  # the one route with OpenAI-style error bodies; every other one is an admin route
# What every route can answer: its 400 (body problems) in its own shape, and a backend failure.
_FAILED = errors(EngineError, "5XX")
_ADMIN: dict[int | str, dict[str, Any]] = {
    **errors(AdminAnswer, 400),
    **_FAILED,
    200: {"model": AdminAnswer, "description": "Done"},
}
_EMPTY_OK: dict[int | str, dict[str, Any]] = {200: {"description": "Done (empty body)"}}
_BODIES = (
    GenerateReqInput,
    SamplingParams,
    AbortReq,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    InitWeightsUpdateGroupReqInput,
    BeginWeightUpdateReqInput,
    UpdateWeightsFromDistributedReqInput,
    EndWeightUpdateReqInput,
    DestroyWeightsUpdateGroupReqInput,
    GetWeightsByNameReqInput,
    LoadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightVersionReqInput,
)


def build_app(backend: EngineBackend, *, title: str) -> FastAPI:
    """The FastAPI app serving SGLang's protocol for `backend`."""
    app = FastAPI(title=title)
    app.add_middleware(DirectGenerate, backend=backend)
    app.add_middleware(PeerLog, logger=log, what=title)  # which hosts (proxies, trainers) use this server (outermost)
    _error_handlers(app, backend)
    _generation_routes(app, backend)
    _info_routes(app, backend)
    _control_routes(app, backend)
    _weight_routes(app, backend)
    _lora_routes(app, backend)
    publish(app, _BODIES, edit=_typed_sampling)
    return app


def _typed_sampling(schema: dict[str, Any]) -> None:
    """`sampling_params` is parsed per prompt (so a batch's errors name the prompt) but documented as the model."""
    props = schema["components"]["schemas"]["GenerateReqInput"]["properties"]
    one = {"$ref": "#/components/schemas/SamplingParams"}
    props["sampling_params"] = {"anyOf": [one, {"type": "array", "items": one}, {"type": "null"}]}


def _error_handlers(app: FastAPI, backend: EngineBackend) -> None:
    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> JSONResponse:
        return failure_response(request, exc, backend)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(f"invalid request: {exc.errors()}", 400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return failure_response(request, exc, backend)


def failure_response(request: Request, exc: Exception, backend: EngineBackend) -> JSONResponse:
    """The answer to a handler's exception: a `RequestError` is the caller's 400, anything else is logged and
    answered with the backend's failure status."""
    if isinstance(exc, RequestError):
        return error_response(str(exc), 400, admin=request.url.path != _GENERATE)
    log.exception("unhandled error in a request handler", exc_info=exc)
    # An adapter's unexpected errors are its upstream's (502): they speak for themselves.
    label = "internal error: " if backend.failure_status == 500 else ""
    return error_response(f"{label}{type(exc).__name__}: {exc}", backend.failure_status)


class DirectGenerate:
    """ASGI middleware that serves `POST /generate` with the route's own handler (`generate_answer`), around
    FastAPI's router, its request wrapper and its exception middleware; every other request goes on to the app.

    Why: profiled under the demo's load (512 concurrent completions a step), those layers were about a fifth
    of the engine's CPU, more than the handler itself. The answers are the route's: the same function, and
    exceptions answered by `failure_response`, as the app's exception handlers answer them. The route stays
    registered, so /openapi.json documents it as before.
    """

    def __init__(self, app: Any, backend: EngineBackend) -> None:
        self.app = app
        self.backend = backend

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != _GENERATE or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await generate_answer(request, self.backend)
        except Exception as exc:
            response = failure_response(request, exc, self.backend)
        await response(scope, receive, send)


def _generation_routes(app: FastAPI, backend: EngineBackend) -> None:
    async def health(generate: bool) -> Response:
        check = await backend.health(generate=generate)
        if check.ok:
            return Response(status_code=200)
        return error_response(check.message or "the engine is not ready", 503)

    health_doc = {**_EMPTY_OK, **errors(EngineError, 503, "5XX")}

    # response_class=Response: a 200 has no body, so no content type (FastAPI would document JSON).
    @app.get("/health", response_model=None, response_class=Response, responses=health_doc)
    async def health_route() -> Response:
        return await health(False)

    @app.get("/health_generate", response_model=None, response_class=Response, responses=health_doc)
    async def health_generate() -> Response:
        return await health(True)

    events_doc = sse_stream({"$ref": "#/components/schemas/GenerateResponse"}, done_marker=True)
    generated = {
        "model": GenerateResponse | list[GenerateResponse],
        "content": events_doc,
        "description": "The completion (a list for a batch or n > 1), or with stream=true its "
        "Server-Sent Events, then `data: [DONE]`",
    }

    @app.post(
        _GENERATE,
        response_model=None,
        openapi_extra=json_body(GenerateReqInput),
        responses={200: generated, **errors(EngineError, 400, "5XX")},
    )
    async def generate(request: Request) -> Response:
        return await generate_answer(request, backend)


async def generate_answer(request: Request, backend: EngineBackend) -> Response:
    """`POST /generate` (served by `DirectGenerate`; the route above is the same function)."""
    backend.requests_total += 1
    body = await parse_body(request, GenerateReqInput)
    items = expand(body, backend.limits, backend.tokenizer)
    unknown = sorted({i.lora for i in items if i.lora is not None} - set(backend.loaded_adapters()))
    if unknown:
        raise RequestError(
            f"lora_path names adapters that are not loaded: {unknown}; loaded: "
            f"{sorted(backend.loaded_adapters())} (load one with /load_lora_adapter)"
        )
    if not backend.serves_input_logprobs and any(i.logprob_start_len >= 0 for i in items):
        raise RequestError("logprob_start_len >= 0 (prompt logprobs) is not supported by this engine")
    text = body.return_text_in_logprobs
    if body.stream:
        return StreamingResponse(events(backend, items[0], text), media_type="text/event-stream")
    results = await until_disconnect(request, [complete(backend, item, text) for item in items])
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(results if body.is_batch() or len(results) > 1 else results[0])


def _info_routes(app: FastAPI, backend: EngineBackend) -> None:
    # SGLang's current names, and the deprecated ones it still serves (older clients call them).
    async def model_info() -> JSONResponse:
        return JSONResponse(backend.model_info())

    async def server_info() -> JSONResponse:
        return JSONResponse(backend.server_info())

    for path in ("/model_info", "/get_model_info"):
        app.get(path, response_model=None, responses={200: {"model": ModelInfo}, **_FAILED})(model_info)
    for path in ("/server_info", "/get_server_info"):
        app.get(path, response_model=None, responses={200: {"model": ServerInfo}, **_FAILED})(server_info)
    # SGLang's answer is plain text (what was flushed, or why not); GET and POST are separate operations.
    flushed = {"content": {"text/plain": {"schema": {"type": "string"}}}}
    flush_doc: dict[int | str, Any] = {
        200: {**flushed, "description": "Flushed"},
        400: {**flushed, "description": "Not flushed (requests run)"},
    }

    async def flush_cache() -> Response:
        check = await backend.flush_cache()
        return PlainTextResponse(check.message, status_code=200 if check.ok else 400)

    app.get("/flush_cache", response_model=None, responses={**flush_doc, **_FAILED}, operation_id="flush_cache_get")(
        flush_cache
    )
    app.post("/flush_cache", response_model=None, responses={**flush_doc, **_FAILED}, operation_id="flush_cache_post")(
        flush_cache
    )


def _admin(body: type[BaseModel] | None = None, *, optional: bool = False) -> dict[str, Any]:
    """FastAPI route arguments of an admin route: its body (read by `parse_body`), `AdminAnswer` or an error."""
    return {
        "response_model": None,
        "responses": _ADMIN,
        "openapi_extra": json_body(body, required=not optional) if body else None,
    }


def _control_routes(app: FastAPI, backend: EngineBackend) -> None:
    @app.post(
        "/abort_request",
        response_model=None,
        response_class=Response,
        openapi_extra=json_body(AbortReq),
        responses={**_EMPTY_OK, **errors(AdminAnswer, 400), **_FAILED},
    )
    async def abort_request(request: Request) -> Response:
        body = await parse_body(request, AbortReq)
        if not body.abort_all and not body.rid:
            raise RequestError("give a rid to abort, or abort_all=true")
        await backend.abort(None if body.abort_all else body.rid, body.abort_message or "aborted by /abort_request")
        return Response(status_code=200)

    @app.post("/pause_generation", **_admin(PauseGenerationReqInput, optional=True))
    async def pause_generation(request: Request) -> JSONResponse:
        body = await parse_body(request, PauseGenerationReqInput, allow_empty=True)
        return _success(await backend.pause(body.mode))

    @app.post("/continue_generation", **_admin())
    async def continue_generation() -> JSONResponse:
        await backend.resume()
        return _success("generation continued")


def _weight_routes(app: FastAPI, backend: EngineBackend) -> None:
    session = _Session()

    @app.post("/update_weights_from_disk", **_admin(UpdateWeightFromDiskReqInput))
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightFromDiskReqInput)
        version = parse_version(body.weight_version)
        message = await backend.update_from_disk(body.model_path, version, body.abort_all_requests)
        return _success(message, num_paused_requests=0)

    @app.post("/init_weights_update_group", **_admin(InitWeightsUpdateGroupReqInput))
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await parse_body(request, InitWeightsUpdateGroupReqInput)
        return _success(await backend.join_group(body))

    @app.post("/begin_weight_update", **_admin(BeginWeightUpdateReqInput, optional=True))
    async def begin_weight_update(request: Request) -> JSONResponse:
        await parse_body(request, BeginWeightUpdateReqInput, allow_empty=True)
        session.begin()
        try:
            await backend.begin_update()
        except BaseException:
            session.open = False
            raise
        return _success("weight-update session open")

    @app.post("/update_weights_from_distributed", **_admin(UpdateWeightsFromDistributedReqInput))
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightsFromDistributedReqInput)
        session.require("update_weights_from_distributed")
        version = parse_version(body.weight_version)
        return _success(await backend.update_from_group(body, version))

    @app.post("/end_weight_update", **_admin(EndWeightUpdateReqInput, optional=True))
    async def end_weight_update(request: Request) -> JSONResponse:
        await parse_body(request, EndWeightUpdateReqInput, allow_empty=True)
        session.end()  # closed first: a failed finish must not wedge the server in a session nobody can close
        await backend.end_update()
        return _success("weight-update session closed")

    @app.post("/destroy_weights_update_group", **_admin(DestroyWeightsUpdateGroupReqInput, optional=True))
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await parse_body(request, DestroyWeightsUpdateGroupReqInput, allow_empty=True)
        return _success(await backend.leave_group(body.group_name))

    async def get_weights_by_name(request: Request) -> JSONResponse:
        # SGLang answers the bare list of rows (its 400 body is {"error": {"message"}}; ours is the admin one).
        body = await parse_body(request, GetWeightsByNameReqInput)
        return JSONResponse(await backend.weights_by_name(body.name, body.truncate_size))

    rows = {"model": WeightRows, "description": "The parameter's first rows"}
    for method in ("get", "post"):  # one operation each (a shared one would repeat its operationId)
        route = app.get if method == "get" else app.post
        route(
            "/get_weights_by_name",
            response_model=None,
            openapi_extra=json_body(GetWeightsByNameReqInput),
            operation_id=f"get_weights_by_name_{method}",
            responses={200: rows, **errors(AdminAnswer, 400), **_FAILED},
        )(get_weights_by_name)


def _lora_routes(app: FastAPI, backend: EngineBackend) -> None:
    """SGLang's LoRA routes: its answer shape (`LoraAnswer`) for success and for every refusal alike."""
    answers: dict[int | str, dict[str, Any]] = {
        200: {"model": LoraAnswer, "description": "Done"},
        400: {"model": LoraAnswer, "description": "Refused"},
        **_FAILED,
    }

    async def lora_call(request: Request, model: type[M], call: Any) -> JSONResponse:
        try:
            loaded = await call(await parse_body(request, model))
        except RequestError as exc:
            body = {"success": False, "error_message": str(exc), "loaded_adapters": backend.loaded_adapters()}
            return JSONResponse(body, status_code=400)
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": loaded})

    @app.post(
        "/load_lora_adapter", response_model=None, responses=answers, openapi_extra=json_body(LoadLoRAAdapterReqInput)
    )
    async def load_lora_adapter(request: Request) -> JSONResponse:
        return await lora_call(request, LoadLoRAAdapterReqInput, backend.load_lora_adapter)

    @app.post(
        "/unload_lora_adapter",
        response_model=None,
        responses=answers,
        openapi_extra=json_body(UnloadLoRAAdapterReqInput),
    )
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        return await lora_call(request, UnloadLoRAAdapterReqInput, backend.unload_lora_adapter)

    @app.post("/update_weight_version", **_admin(UpdateWeightVersionReqInput))
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightVersionReqInput)
        version = parse_version(body.new_version)
        assert version is not None  # new_version is required
        return _success(await backend.update_weight_version(body, version))


class _Session:
    """SGLang's weight-update session: at most one open; broadcast updates only inside one."""

    def __init__(self) -> None:
        self.open = False

    def begin(self) -> None:
        if self.open:
            raise RequestError("a weight-update session is already open; call /end_weight_update first")
        self.open = True

    def require(self, what: str) -> None:
        if not self.open:
            raise RequestError(f"{what} must run between /begin_weight_update and /end_weight_update")

    def end(self) -> None:
        if not self.open:
            raise RequestError("no weight-update session is open; call /begin_weight_update first")
        self.open = False


def _success(message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})
