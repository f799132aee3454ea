"""HTTP routes of the vLLM adapter (SGLang's endpoint names and bodies; behaviour in `vllm_adapter.py`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request

from pipeline.engine.http_errors import BadRequest, error_response, parse_body
from pipeline.engine.protocol import RequestError, expand
from schemas.engine_api import (
    AbortReq,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
)

if TYPE_CHECKING:
    from pipeline.engine.vllm_adapter import VLLMAdapter


def register_routes(adapter: VLLMAdapter) -> Any:
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="arl vLLM adapter (SGLang protocol)")

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc), 400, admin=exc.admin)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(f"invalid request: {exc.errors()}", 400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(f"{type(exc).__name__}: {exc}", 502)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        try:
            resp = await adapter.http.get("/health", timeout=5.0)
        except Exception as exc:
            return error_response(f"vLLM server unreachable: {exc}", 503)
        return Response(status_code=200 if resp.status_code == 200 else 503)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await parse_body(request, GenerateReqInput)
        try:
            items = expand(body, adapter.limits, adapter.tokenizer)
        except RequestError as exc:
            raise BadRequest(str(exc)) from None
        if body.stream:
            return StreamingResponse(adapter.stream(items[0]), media_type="text/event-stream")
        results = await asyncio.gather(*(adapter.complete(item) for item in items))
        return JSONResponse(results if body.is_batch() or len(results) > 1 else results[0])

    _info_routes(app, adapter)
    _control_routes(app, adapter)
    _weight_routes(app, adapter)
    return app


def _info_routes(app: Any, adapter: VLLMAdapter) -> None:
    """Model/server info and the cache flush."""
    from fastapi.responses import Response

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": adapter.model_path,
            "tokenizer_path": adapter.config.tokenizer_path or adapter.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(adapter.weight_version),
            "max_context": adapter.limits.max_context,
            "context_length": adapter.limits.max_context,
            "vocab_size": adapter.limits.vocab_size,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return {
            "backend": "vllm",
            "upstream": adapter.config.upstream,
            "model_path": adapter.model_path,
            "tp_size": adapter.config.tp_size,
            "dp_size": 1,
            "weight_version": str(adapter.weight_version),
            "paused": adapter.paused,
            "running": len(adapter.inflight),
        }

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": str(adapter.weight_version)}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        resp = await adapter.http.post("/reset_prefix_cache")
        return Response("Cache flushed.\n", status_code=200 if resp.status_code < 400 else 400)


def _control_routes(app: Any, adapter: VLLMAdapter) -> None:
    """Abort, pause and continue."""
    from fastapi.responses import JSONResponse, Response

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await parse_body(request, AbortReq, admin=True)
        if not body.abort_all and not body.rid:
            raise BadRequest("give a rid to abort, or abort_all=true", admin=True)
        adapter.abort(None if body.abort_all else body.rid)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await parse_body(request, PauseGenerationReqInput, admin=True, allow_empty=True)
        adapter.paused = True
        adapter.open.clear()
        if body.mode == "abort":
            adapter.abort(None)
        return JSONResponse({"success": True, "message": f"new requests held (mode {body.mode})"})

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        adapter.paused = False
        adapter.open.set()
        return JSONResponse({"success": True, "message": "generation continued"})


def _weight_routes(app: Any, adapter: VLLMAdapter) -> None:
    """Weight updates through vLLM's /collective_rpc."""
    from fastapi.responses import JSONResponse

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightFromDiskReqInput, admin=True)
        version = _version(body.weight_version)
        if not (Path(body.model_path) / "config.json").exists():
            raise BadRequest(f"model_path {body.model_path!r} is not a Hugging Face model directory", admin=True)
        async with adapter.update_lock:
            await adapter.drain(body.abort_all_requests)
            try:
                await adapter.rpc("arl_reload_from_disk", body.model_path)
                await adapter.http.post("/reset_prefix_cache")
            finally:
                adapter.reopen()
            adapter.model_path = body.model_path
            adapter.weight_version = adapter.weight_version if version is None else version
        return JSONResponse({"success": True, "message": f"reloaded {body.model_path}", "num_paused_requests": 0})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await parse_body(request, InitWeightsUpdateGroupReqInput, admin=True)
        await adapter.rpc("arl_init_group", body.model_dump_json())
        return JSONResponse({"success": True, "message": f"joined {body.group_name}"})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightsFromDistributedReqInput, admin=True)
        version = _version(body.weight_version)
        _vet_names(adapter, body)
        spec = json.dumps(
            {"names": body.names, "dtypes": body.dtypes, "shapes": body.shapes, "group_name": body.group_name}
        )
        async with adapter.update_lock:
            await adapter.drain(body.abort_all_requests)
            try:
                await adapter.rpc("arl_receive", spec)
                await adapter.http.post("/reset_prefix_cache")
            finally:
                adapter.reopen()
            adapter.weight_version = adapter.weight_version if version is None else version
        return JSONResponse({"success": True, "message": f"received {len(body.names)} tensors"})


def _version(value: str | int | None) -> int | None:
    if value is None:
        return None
    try:
        version = int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"weight_version must be a non-negative integer, got {value!r}", admin=True) from None
    if version < 0:
        raise BadRequest(f"weight_version must be >= 0, got {version}", admin=True)
    return version


def _vet_names(adapter: VLLMAdapter, body: UpdateWeightsFromDistributedReqInput) -> None:
    """Refuse unknown names / wrong shapes before the trainer starts broadcasting (checkpoint names)."""
    known = adapter.checkpoint_shapes
    unknown = [n for n in body.names if n not in known and n != "lm_head.weight"]
    if unknown:
        raise BadRequest(f"{len(unknown)} names are not in the served checkpoint, e.g. {unknown[:5]}", admin=True)
    bad = [(n, s, known[n]) for n, s in zip(body.names, body.shapes, strict=True) if n in known and s != known[n]]
    if bad:
        raise BadRequest(f"shape mismatch (name, got, expected): {bad[:5]}", admin=True)
