"""The `hf` engine's weight updates (from disk; over a broadcast group: join, receive, leave) and reads.

Updates follow SGLang (see `batcher.py` for when they apply; docs/inference.md, "Weight updates").
A checkpoint or tensor list that does not fit the model is a `RequestError` (400) with the model
left untouched: everything is checked before anything is copied.

Broadcast updates are atomic per version. The buckets `/update_weights_from_distributed` receives
inside a session (`/begin_weight_update` ... `/end_weight_update`) are staged, kept on the engine's
device, and copied into the model all together at one scheduler step boundary when the bucket that
carries `weight_version` arrives; what is still staged at `/end_weight_update` (a client that sends
no version, as plain SGLang users do) is applied then. A receive that fails (the group broke, a gloo
timeout, the trainer died) or a refused bucket discards everything the session staged: the weights
and the version stay as they were, never half of a version. The cost is one extra copy, on the
device, of what a session sends before its version bucket (a full publication: the model's size).

`weights_by_name` reads a parameter back (SGLang's `/get_weights_by_name`) on the scheduler thread,
between two steps, so it never sees an update half applied. `maybe_corrupt` is a test hook.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.engine.server.hf.batcher import Scheduler
from pipeline.engine.server.requests import RequestError
from pipeline.engine.server.weights import (
    apply_named_tensors,
    check_named_tensors,
    read_checkpoint,
    swap_named_tensors,
    to_model_names,
)
from pipeline.engine.weight_group import destroy_weight_group, init_weight_group, parse_dtype, receive_from_trainer
from schemas.engine_api import InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput

log = logging.getLogger("arl.engine.hf_weights")

CORRUPT_ENV = "ARL_TEST_CORRUPT_WEIGHTS"
STALL_ENV = "ARL_TEST_STALL_UPDATE_S"
"""Test hook (`maybe_corrupt`): a JSON file {"version": int, "name": str}; unset in every real run."""


@dataclass
class StagedUpdate:
    """The received, not yet applied buckets of the open weight-update session."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    abort_all: bool = False
    spare: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per parameter, the storage it had before the last broadcast swapped it out: the next version is
    received into it (no allocation and no copy, for one spare copy of the broadcast weights in memory)."""
    """Some bucket asked `abort_all_requests`: the requests in flight are aborted when they are applied."""

    def take(self) -> tuple[dict[str, torch.Tensor], bool]:
        """What is staged (and the abort flag); empties the stage."""
        taken = self.tensors, self.abort_all
        self.tensors, self.abort_all = {}, False
        return taken


class WeightUpdates:
    """The weight-update methods of `HFEngine` (a mixin: the engine provides these attributes)."""

    model: Any
    model_path: str
    device: Any
    scheduler: Scheduler
    weight_groups: dict[str, Any]
    staged: StagedUpdate
    config: Any  # HFEngineConfig: `weight_group_timeout_s`

    async def update_from_disk(self, model_path: str, version: int | None, abort_all: bool) -> str:
        try:
            tensors = to_model_names(self.model, await asyncio.to_thread(read_checkpoint, model_path))
            check_named_tensors(self.model, tensors, require_all=True)
            maybe_corrupt(tensors, version)
            await maybe_stall()
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
        """Start staging (generation should be paused around a session, as for SGLang)."""
        self._discard("a new weight-update session began")

    async def end_update(self) -> None:
        """Apply what the session staged and no version bucket applied (a client that sends no version)."""
        if self.staged.tensors:
            await self._apply_staged(None)

    async def update_from_group(self, body: UpdateWeightsFromDistributedReqInput, version: int | None) -> str:
        """Receive one bucket into the stage; the bucket carrying `version` applies the whole stage."""
        group = self.weight_groups.get(body.group_name)
        try:
            if group is None:
                raise ValueError(f"no weight update group {body.group_name!r}: call /init_weights_update_group first")
            for dtype in body.dtypes:
                parse_dtype(dtype)  # refuse unknown dtype names before the trainer starts sending
            check_named_tensors(self.model, list(zip(body.names, body.shapes, strict=True)), require_all=False)
        except ValueError as exc:
            dropped = self._discard(f"a bucket was refused: {exc}")
            raise RequestError(f"{exc}{_dropped_note(dropped)}") from None
        try:  # beside the scheduler: generation goes on while the bucket arrives
            into = [self._spare(n, d, s) for n, d, s in zip(body.names, body.dtypes, body.shapes, strict=True)]
            received = await asyncio.to_thread(receive_from_trainer, group, body.dtypes, body.shapes, self.device, into)
        except Exception as exc:  # the group broke, a timeout, the trainer died: nothing of this version applies
            error = f"{type(exc).__name__}: {exc}"
            dropped = self._discard(f"receiving over group {body.group_name!r} failed: {error}")
            raise RequestError(
                f"receiving {len(body.names)} tensors over group {body.group_name!r} failed: {error}; "
                f"weights and weight_version {self.scheduler.weight_version} unchanged{_dropped_note(dropped)}"
            ) from None
        self.staged.tensors.update(zip(body.names, received, strict=True))
        self.staged.abort_all |= body.abort_all_requests
        if version is None:
            return (
                f"staged {len(body.names)} tensors over {body.group_name} ({len(self.staged.tensors)} in this "
                "session); they apply with the bucket carrying weight_version, or at /end_weight_update"
            )
        count = await self._apply_staged(version)
        return f"received and applied {count} tensors over {body.group_name}; weight_version {version}"

    async def leave_group(self, group_name: str) -> str:
        group = self.weight_groups.pop(group_name, None)
        if group is None:
            raise RequestError(f"no weight update group {group_name!r}")
        destroy_weight_group(group)
        # A group left before its version's last bucket (a trainer that gave up on it) leaves nothing behind.
        dropped = self._discard(f"group {group_name!r} was destroyed before its version arrived")
        return f"destroyed {group_name}{_dropped_note(dropped)}"

    async def weights_by_name(self, name: str, truncate_size: int) -> list[Any]:
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied lm_head.weight is listed
        param = params.get(name)
        if param is None:
            raise RequestError(
                f"{name!r} is not a parameter of the served model {self.model_path}; "
                f"its {len(params)} names look like {list(params)[:3]}"
            )
        if param.dim() == 0:
            raise RequestError(f"{name!r} is a scalar: there are no rows to return")
        # A copy taken between two scheduler steps: an update never lands half-way through the read.
        rows = await asyncio.wrap_future(
            self.scheduler.call(lambda: param.detach()[:truncate_size].to("cpu", torch.float32, copy=True))
        )
        return list(rows.tolist())

    async def _apply_staged(self, version: int | None) -> int:
        tensors, abort_all = self.staged.take()
        maybe_corrupt(tensors, version)
        try:
            return await self._apply(tensors, version, abort_all, swap=True)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def _spare(self, name: str, dtype: str, shape: list[int]) -> torch.Tensor | None:
        """The spare storage of `name` when it fits what arrives (else the receive allocates)."""
        spare = self.staged.spare.pop(name, None)
        fits = spare is not None and spare.dtype == parse_dtype(dtype) and list(spare.shape) == list(shape)
        return spare if fits else None

    def _discard(self, why: str) -> int:
        """Drop what the session staged (logged with `why`); returns how many tensors."""
        tensors, _ = self.staged.take()
        if tensors:
            log.error("discarded %d staged tensors, weights unchanged: %s", len(tensors), why)
        return len(tensors)

    async def _apply(self, tensors: dict[str, Any], version: int | None, abort_all: bool, swap: bool = False) -> int:
        """Load `tensors` into the model between two scheduler steps (SGLang's update semantics): copied, or
        (`swap`: received buffers of the parameters' own dtype) swapped in, the old storage kept as spare."""
        spare = self.staged.spare
        apply = (
            (lambda: swap_named_tensors(self.model, tensors, spare))
            if swap
            else (lambda: apply_named_tensors(self.model, tensors))
        )
        return int(await asyncio.wrap_future(self.scheduler.update(apply, version=version, abort_all=abort_all)))


def _dropped_note(dropped: int) -> str:
    return f"; discarded the {dropped} tensors staged earlier in this session" if dropped else ""


def maybe_corrupt(tensors: dict[str, torch.Tensor], version: int | None) -> None:
    """TEST HOOK, inert unless the environment variable ARL_TEST_CORRUPT_WEIGHTS is set: fakes one tensor
    arriving wrong, so tests can show that weight-swap verification catches it.

    The variable names a JSON file {"version": int, "name": "<parameter name>"}. When this server is about
    to load that parameter for that version (broadcast or disk), it first claims the file with
    `os.rename` to `<path>.claimed`: of several servers sharing the file only the winner goes on, so exactly
    one server corrupts, exactly once, and a restarted server finds nothing left to claim. The winner adds
    1.0 to the first element of the received tensor (a real change of the bits it then serves) and loads
    it as usual.
    """
    path = os.environ.get(CORRUPT_ENV)
    if not path or version is None:
        return
    try:
        spec = json.loads(Path(path).read_text())
    except FileNotFoundError:  # claimed already, by this server or another
        return
    name = spec.get("name")
    if spec.get("version") != version or name not in tensors:
        return
    try:
        os.rename(path, f"{path}.claimed")
    except FileNotFoundError:  # another server claimed it between our read and our rename
        return
    tensor = tensors[name]
    tensor[(0,) * tensor.dim()] += 1.0
    log.warning(
        "%s: corrupted %s of weight_version %d on purpose (+1.0 on its first element)", CORRUPT_ENV, name, version
    )


async def maybe_stall() -> None:
    """TEST HOOK, inert unless the environment variable ARL_TEST_STALL_UPDATE_S is set: a disk update waits
    that many seconds before it applies, so a test can kill the inference stage while the trainer holds its
    servers paused in the middle of a swap."""
    seconds = float(os.environ.get(STALL_ENV) or 0)
    if seconds > 0:
        log.warning("%s: holding this weight update %.1fs before applying it", STALL_ENV, seconds)
        await asyncio.sleep(seconds)
