"""The `hf` engine's three weight-update paths: from disk, and over a broadcast group (join, receive, leave).

Updates follow SGLang (see `batcher.py` for when they apply; docs/inference.md, "Weight updates").
A checkpoint or tensor list that does not fit the model is a `RequestError` (400) with the model
left untouched: everything is checked before anything is copied.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pipeline.engine.server.batcher import Scheduler
from pipeline.engine.server.requests import RequestError
from pipeline.engine.server.weights import apply_named_tensors, check_named_tensors, read_checkpoint
from pipeline.engine.weight_group import destroy_weight_group, init_weight_group, parse_dtype, receive_from_trainer
from schemas.engine_api import InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput

log = logging.getLogger("arl.engine.hf_weights")


class WeightUpdates:
    """The weight-update methods of `HFEngine` (a mixin: the engine provides these attributes)."""

    model: Any
    model_path: str
    device: Any
    scheduler: Scheduler
    weight_groups: dict[str, Any]
    config: Any  # HFEngineConfig: `weight_group_timeout_s`

    async def update_from_disk(self, model_path: str, version: int | None, abort_all: bool) -> str:
        try:
            tensors = await asyncio.to_thread(read_checkpoint, model_path)
            check_named_tensors(self.model, tensors, require_all=True)
            count = await self._apply(tensors, version, abort_all)
        except ValueError as exc:  # WeightError and friends: the checkpoint does not fit
            raise RequestError(str(exc)) from None
        self.model_path = model_path
        message = f"loaded {count} tensors from {model_path}; weight_version {self.scheduler.weight_version}"
        log.info(message)
        return message

    async def join_group(self, body: InitWeightsUpdateGroupReqInput) -> str:
        if body.backend == "nccl" and self.device.type != "cuda":
            raise RequestError(f"backend nccl needs a CUDA device; this server runs on {self.device}: use gloo")
        if body.group_name in self.weight_groups:
            raise RequestError(f"group {body.group_name!r} exists; destroy it first")
        try:
            group = await asyncio.to_thread(
                init_weight_group,
                body.master_address,
                body.master_port,
                rank=body.rank_offset,
                world_size=body.world_size,
                group_name=body.group_name,
                backend=body.backend,
                timeout_s=self.config.weight_group_timeout_s,
            )
        except Exception as exc:  # rendezvous timeout or refused: report it, keep serving
            raise RequestError(
                f"could not join group {body.group_name!r} at {body.master_address}:"
                f"{body.master_port} as rank {body.rank_offset}: {exc}"
            ) from None
        self.weight_groups[body.group_name] = group
        return f"joined {body.group_name} as rank {body.rank_offset}"

    async def begin_update(self) -> None:
        """Nothing to prepare: each bucket is copied into the parameters at a step boundary (generation
        should be paused around a session, as for SGLang, so that no token sees half-updated weights)."""

    async def end_update(self) -> None:
        """Nothing to finish: every bucket was applied as it arrived."""

    async def update_from_group(self, body: UpdateWeightsFromDistributedReqInput, version: int | None) -> str:
        group = self.weight_groups.get(body.group_name)
        if group is None:
            raise RequestError(f"no weight update group {body.group_name!r}: call /init_weights_update_group first")
        try:
            for dtype in body.dtypes:
                parse_dtype(dtype)  # refuse unknown dtype names before the trainer starts sending
            check_named_tensors(self.model, list(zip(body.names, body.shapes, strict=True)), require_all=False)
            # Receive beside the scheduler (generation goes on), then swap in at a step boundary.
            received = await asyncio.to_thread(receive_from_trainer, group, body.dtypes, body.shapes, self.device)
            tensors = dict(zip(body.names, received, strict=True))
            count = await self._apply(tensors, version, body.abort_all_requests)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return f"received {count} tensors over {body.group_name}; weight_version {self.scheduler.weight_version}"

    async def leave_group(self, group_name: str) -> str:
        group = self.weight_groups.pop(group_name, None)
        if group is None:
            raise RequestError(f"no weight update group {group_name!r}")
        destroy_weight_group(group)
        return f"destroyed {group_name}"

    async def _apply(self, tensors: dict[str, Any], version: int | None, abort_all: bool) -> int:
        """Copy `tensors` into the model between two scheduler steps (SGLang's update semantics)."""
        apply = lambda: apply_named_tensors(self.model, tensors)  # noqa: E731
        return int(await asyncio.wrap_future(self.scheduler.update(apply, version=version, abort_all=abort_all)))
