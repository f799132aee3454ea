"""Admin routes of the `hf` server: info, abort/pause/continue, and the three weight-update paths.

Weight updates follow SGLang (see `batcher.py` for when they apply). Their answers are SGLang's
`{"success": bool, "message": str}`; a checkpoint or tensor list that does not fit the model is a
400 with the model left untouched.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fastapi import Request

from pipeline.engine.http_errors import BadRequest, parse_body
from schemas.engine_api import (
    AbortReq,
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
)

if TYPE_CHECKING:
    from pipeline.engine.hf_server import HFServer

log = logging.getLogger("arl.engine.hf_admin")


def register_admin_routes(app: Any, server: HFServer) -> None:
    """Info, control and weight-update routes on `app`."""
    _info_routes(app, server)
    _control_routes(app, server)
    _weight_routes(app, server)


def _info_routes(app: Any, server: HFServer) -> None:
    """Model/server info and the cache flush."""
    from fastapi.responses import Response

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return server.model_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return server.server_info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": str(server.scheduler.weight_version)}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # The hf engine keeps no prefix cache across requests: there is nothing to flush.
        return Response("Cache flushed (the hf engine keeps no prefix cache).\n", status_code=200)


def _control_routes(app: Any, server: HFServer) -> None:
    """Abort, pause and continue."""
    from fastapi.responses import JSONResponse, Response

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await parse_body(request, AbortReq, admin=True)
        if not body.abort_all and not body.rid:
            raise BadRequest("give a rid to abort, or abort_all=true", admin=True)
        rid = None if body.abort_all else body.rid
        message = body.abort_message or "aborted by /abort_request"
        await _on_scheduler(server, lambda: server.scheduler.abort(rid, message))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await parse_body(request, PauseGenerationReqInput, admin=True, allow_empty=True)
        await _on_scheduler(server, lambda: server.scheduler.pause(body.mode))
        return JSONResponse({"success": True, "message": f"generation paused (mode {body.mode})"})

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        await _on_scheduler(server, server.scheduler.resume)
        return JSONResponse({"success": True, "message": "generation continued"})


def _weight_routes(app: Any, server: HFServer) -> None:
    """The three weight-update paths (disk, group join/destroy, broadcast)."""
    from fastapi.responses import JSONResponse

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightFromDiskReqInput, admin=True)
        version = _version(body.weight_version, BadRequest)
        try:
            count = await _update_from_disk(server, body.model_path, version, body.abort_all_requests)
        except ValueError as exc:  # WeightError and friends: the checkpoint does not fit
            raise BadRequest(str(exc), admin=True) from None
        server.model_path = body.model_path
        message = f"loaded {count} tensors from {body.model_path}; weight_version {server.scheduler.weight_version}"
        log.info(message)
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await parse_body(request, InitWeightsUpdateGroupReqInput, admin=True)
        if body.backend == "nccl" and server.device.type != "cuda":
            raise BadRequest(
                f"backend nccl needs a CUDA device; this server runs on {server.device}: use gloo", admin=True
            )
        if body.group_name in server.weight_groups:
            raise BadRequest(f"group {body.group_name!r} exists; destroy it first", admin=True)
        try:
            group = await asyncio.to_thread(_join_group, server, body)
        except Exception as exc:  # rendezvous timeout or refused: report it, keep serving
            raise BadRequest(
                f"could not join group {body.group_name!r} at {body.master_address}:"
                f"{body.master_port} as rank {body.rank_offset}: {exc}",
                admin=True,
            ) from None
        server.weight_groups[body.group_name] = group
        return JSONResponse({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        from pipeline.engine.weight_group import destroy_weight_group

        body = await parse_body(request, DestroyWeightsUpdateGroupReqInput, admin=True, allow_empty=True)
        group = server.weight_groups.pop(body.group_name, None)
        if group is None:
            raise BadRequest(f"no weight update group {body.group_name!r}", admin=True)
        destroy_weight_group(group)
        return JSONResponse({"success": True, "message": f"destroyed {body.group_name}"})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await parse_body(request, UpdateWeightsFromDistributedReqInput, admin=True)
        version = _version(body.weight_version, BadRequest)
        group = server.weight_groups.get(body.group_name)
        if group is None:
            raise BadRequest(
                f"no weight update group {body.group_name!r}: call /init_weights_update_group first", admin=True
            )
        try:
            count = await _update_from_group(server, group, body, version)
        except ValueError as exc:
            raise BadRequest(str(exc), admin=True) from None
        message = f"received {count} tensors over {body.group_name}; weight_version {server.scheduler.weight_version}"
        return JSONResponse({"success": True, "message": message})


async def _on_scheduler(server: HFServer, fn: Any) -> Any:
    return await asyncio.wrap_future(server.scheduler.call(fn))


def _version(value: str | int | None, error: type[Exception]) -> int | None:
    if value is None:
        return None
    try:
        version = int(value)
    except (TypeError, ValueError):
        raise error(
            f"weight_version must be a non-negative integer (arl's versions), got {value!r}", admin=True
        ) from None  # type: ignore[call-arg]
    if version < 0:
        raise error(f"weight_version must be >= 0, got {version}", admin=True)  # type: ignore[call-arg]
    return version


async def _update_from_disk(server: HFServer, path: str, version: int | None, abort_all: bool) -> int:
    from pipeline.engine.weights import apply_named_tensors, check_named_tensors, read_checkpoint

    tensors = await asyncio.to_thread(read_checkpoint, path)
    check_named_tensors(server.model, tensors, require_all=True)
    apply = lambda: apply_named_tensors(server.model, tensors)  # noqa: E731
    return int(await asyncio.wrap_future(server.scheduler.update(apply, version=version, abort_all=abort_all)))


async def _update_from_group(
    server: HFServer, group: Any, body: UpdateWeightsFromDistributedReqInput, version: int | None
) -> int:
    from pipeline.engine.weight_group import parse_dtype, receive_from_trainer
    from pipeline.engine.weights import apply_named_tensors, check_named_tensors

    for dtype in body.dtypes:
        parse_dtype(dtype)  # refuse unknown dtype names before the trainer starts sending
    check_named_tensors(server.model, list(zip(body.names, body.shapes, strict=True)), require_all=False)
    # Receive beside the scheduler (generation goes on), then swap in at a step boundary.
    received = await asyncio.to_thread(receive_from_trainer, group, body.dtypes, body.shapes, server.device)
    tensors = dict(zip(body.names, received, strict=True))
    apply = lambda: apply_named_tensors(server.model, tensors)  # noqa: E731
    future = server.scheduler.update(apply, version=version, abort_all=body.abort_all_requests)
    return int(await asyncio.wrap_future(future))


def _join_group(server: HFServer, body: InitWeightsUpdateGroupReqInput) -> Any:
    from pipeline.engine.weight_group import init_weight_group

    return init_weight_group(
        body.master_address,
        body.master_port,
        rank=body.rank_offset,
        world_size=body.world_size,
        group_name=body.group_name,
        backend=body.backend,
        timeout_s=server.config.weight_group_timeout_s,
    )
