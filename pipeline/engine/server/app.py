"""The engine's HTTP app: SGLang's native protocol over any `EngineBackend` (the one route table).

Every route of docs/inference.md is here, once, for every backend: `/health`, `/health_generate`,
`/generate` (one answer, or Server-Sent Events), `/model_info`, `/server_info` (and SGLang's
deprecated aliases `/get_model_info`, `/get_server_info`), `/flush_cache`, `/abort_request`,
`/pause_generation`, `/continue_generation`, `/update_weights_from_disk`, `/init_weights_update_group`,
`/begin_weight_update`, `/update_weights_from_distributed`, `/end_weight_update`,
`/destroy_weights_update_group`, `/get_weights_by_name`. Every path is one SGLang 0.5.23 serves, with
its meaning.

Weight-update sessions are SGLang's: `/update_weights_from_distributed` is refused (400, before anything
is received) unless `/begin_weight_update` opened a session that `/end_weight_update` has not closed yet,
so a publisher that would hang against SGLang fails against arl's servers too.

Every body is parsed here; input the server cannot serve is a 400 that names the problem, in
`{"error": {"message", "type", "code"}}` on `/generate` and SGLang's `{"success": false, "message"}`
on the admin routes; never a 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from pipeline.engine.net import PeerLog
from pipeline.engine.server.backend import EngineBackend, Progress
from pipeline.engine.server.requests import (
    PromptLogprobs,
    RequestError,
    WorkItem,
    expand,
    response,
    splice_top,
    top_entries,
)
from pipeline.engine.tokens import TopEntry
from schemas.engine_api import (
    AbortReq,
    BeginWeightUpdateReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    GenerateReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
)

log = logging.getLogger("arl.engine.app")
M = TypeVar("M", bound=BaseModel)
_GENERATE = "/generate"  # the one route with OpenAI-style error bodies; every other one is an admin route


def build_app(backend: EngineBackend, *, title: str) -> FastAPI:
    """The FastAPI app serving SGLang's protocol for `backend`."""
    app = FastAPI(title=title)
    app.add_middleware(PeerLog, logger=log, what=title)  # which hosts (proxies, trainers) use this server
    _error_handlers(app, backend)
    _generation_routes(app, backend)
    _info_routes(app, backend)
    _control_routes(app, backend)
    _weight_routes(app, backend)
    return app


def _error_handlers(app: FastAPI, backend: EngineBackend) -> None:
    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(str(exc), 400, admin=request.url.path != _GENERATE)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(f"invalid request: {exc.errors()}", 400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request handler")
        # An adapter's unexpected errors are its upstream's (502): they speak for themselves.
        label = "internal error: " if backend.failure_status == 500 else ""
        return error_response(f"{label}{type(exc).__name__}: {exc}", backend.failure_status)


def _generation_routes(app: FastAPI, backend: EngineBackend) -> None:
    async def health(generate: bool) -> Response:
        check = await backend.health(generate=generate)
        if check.ok:
            return Response(status_code=200)
        return error_response(check.message, 503) if check.message else Response(status_code=503)

    @app.get("/health")
    async def health_route() -> Response:
        return await health(False)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await health(True)

    @app.post(_GENERATE)
    async def generate(request: Request) -> Response:
        backend.requests_total += 1
        body = await parse_body(request, GenerateReqInput)
        items = expand(body, backend.limits, backend.tokenizer)
        if not backend.serves_input_logprobs and any(i.logprob_start_len >= 0 for i in items):
            raise RequestError("logprob_start_len >= 0 (prompt logprobs) is not supported by this engine")
        text = body.return_text_in_logprobs
        if body.stream:
            return StreamingResponse(_events(backend, items[0], text), media_type="text/event-stream")
        results = await _until_disconnect(request, [_complete(backend, item, text) for item in items])
        if results is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(results if body.is_batch() or len(results) > 1 else results[0])


async def _complete(backend: EngineBackend, item: WorkItem, text_in_logprobs: bool) -> dict[str, Any]:
    """SGLang's response for one completion, once it has finished."""
    ids: list[int] = []
    logprobs: list[float] = []
    top: list[TopEntry] = []
    prompt: PromptLogprobs | None = None
    versions: list[int] = []
    cached = 0
    last = Progress([], [], backend.weight_version)
    async with contextlib.aclosing(backend.generate(item, stream=False)) as progress:
        async for last in progress:
            ids += last.new_ids
            logprobs += last.new_logprobs
            top += last.new_top
            versions += last.versions()
            prompt = prompt or last.prompt
            cached = max(cached, last.cached_tokens)
    return response(
        item,
        ids,
        logprobs,
        last.finish,
        last.weight_version,
        backend.tokenizer,
        top_logprobs=top,
        text_in_logprobs=text_in_logprobs,
        prompt_logprobs=prompt,
        versions=versions,
        cached_tokens=cached,
    )


async def _events(backend: EngineBackend, item: WorkItem, text_in_logprobs: bool) -> AsyncIterator[str]:
    """SSE events like SGLang's: cumulative `output_ids`/`text`/logprobs (deltas with `incremental_stream`)."""
    chunks = _Chunks(item, backend.tokenizer, text_in_logprobs, backend.incremental_stream)
    async with contextlib.aclosing(backend.generate(item, stream=True)) as progress:
        async for event in progress:
            body = chunks.add(event)
            if body is not None:
                yield f"data: {body}\n\n"
    yield "data: [DONE]\n\n"


class _Chunks:
    """The JSON text of each streamed event of one completion.

    Each position's top logprobs are encoded once and spliced into every cumulative event
    (`requests.splice_top` says why). The scored prompt (if asked) is in every event from the first on,
    as SGLang's `meta_info.input_token_logprobs`.
    """

    def __init__(self, item: WorkItem, tokenizer: Any, text_in_logprobs: bool, incremental: bool) -> None:
        self.item, self.tokenizer, self.text_in_logprobs, self.incremental = (
            item,
            tokenizer,
            text_in_logprobs,
            incremental,
        )
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_json: list[str] = []
        self.prompt: PromptLogprobs | None = None
        self.versions: list[int] = []
        self.cached = 0

    def add(self, event: Progress) -> str | None:
        """The event's JSON text, or None when it carries neither tokens nor the finish."""
        start = len(self.ids)
        self.ids += event.new_ids
        self.logprobs += event.new_logprobs
        self.top_json += [json.dumps(e) for e in top_entries(event.new_top, self.tokenizer, self.text_in_logprobs)]
        self.prompt = self.prompt or event.prompt
        self.versions += event.versions()
        self.cached = max(self.cached, event.cached_tokens)
        if not event.new_ids and event.finish is None:
            return None
        chunk = response(
            self.item,
            self.ids,
            self.logprobs,
            event.finish,
            event.weight_version,
            self.tokenizer,
            text_in_logprobs=self.text_in_logprobs,
            prompt_logprobs=self.prompt,
            versions=self.versions,
            cached_tokens=self.cached,
        )
        meta = chunk["meta_info"]
        with_top = meta.pop("output_top_logprobs", None) is not None
        if self.incremental:
            chunk["output_ids"] = self.ids[start:]
            skip = self.item.params.skip_special_tokens
            chunk["text"] = self.tokenizer.decode(self.ids[start:], skip_special_tokens=skip)
            if "output_token_logprobs" in meta:
                meta["output_token_logprobs"] = meta["output_token_logprobs"][start:]
        body = json.dumps(chunk)
        if with_top:
            body = splice_top(body, self.top_json[start:] if self.incremental else self.top_json)
        return body


async def _until_disconnect(request: Request, work: list[Any]) -> list[dict[str, Any]] | None:
    """The results of `work` (coroutines), or None if the client disconnected first (the work is cancelled)."""
    gathered = asyncio.ensure_future(asyncio.gather(*work))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if gathered in done:
        return list(gathered.result())
    gathered.cancel()  # closing the backends' iterators aborts the completions
    return None


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


def _info_routes(app: FastAPI, backend: EngineBackend) -> None:
    # SGLang's current names, and the deprecated ones it still serves (older clients call them).
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return backend.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return backend.server_info()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        check = await backend.flush_cache()
        return Response(check.message, status_code=200 if check.ok else 400)


def _control_routes(app: FastAPI, backend: EngineBackend) -> None:
    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await parse_body(request, AbortReq)
        if not body.abort_all and not body.rid:
            raise RequestError("give a rid to abort, or abort_all=true")
        await backend.abort(None if body.abort_all else body.rid, body.abort_message or "aborted by /abort_request")
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await parse_body(request, PauseGenerationReqInput, allow_empty=True)
        return _success(await backend.pause(body.mode))

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        await backend.resume()
        return _success("generation continued")


def _weight_routes(app: FastAPI, backend: EngineBackend) -> None:
    session = _Session()

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightFromDiskReqInput)
        version = parse_version(body.weight_version)
        message = await backend.update_from_disk(body.model_path, version, body.abort_all_requests)
        return _success(message, num_paused_requests=0)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await parse_body(request, InitWeightsUpdateGroupReqInput)
        return _success(await backend.join_group(body))

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> JSONResponse:
        await parse_body(request, BeginWeightUpdateReqInput, allow_empty=True)
        session.begin()
        try:
            await backend.begin_update()
        except BaseException:
            session.open = False
            raise
        return _success("weight-update session open")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightsFromDistributedReqInput)
        session.require("update_weights_from_distributed")
        version = parse_version(body.weight_version)
        return _success(await backend.update_from_group(body, version))

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> JSONResponse:
        await parse_body(request, EndWeightUpdateReqInput, allow_empty=True)
        session.end()  # closed first: a failed finish must not wedge the server in a session nobody can close
        await backend.end_update()
        return _success("weight-update session closed")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await parse_body(request, DestroyWeightsUpdateGroupReqInput, allow_empty=True)
        return _success(await backend.leave_group(body.group_name))

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> JSONResponse:
        # SGLang answers the bare list of rows (its 400 body is {"error": {"message"}}; ours is the admin one).
        body = await parse_body(request, GetWeightsByNameReqInput)
        return JSONResponse(await backend.weights_by_name(body.name, body.truncate_size))


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
