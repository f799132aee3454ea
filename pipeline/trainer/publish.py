"""Weight publication: get version v onto every registered inference server, then announce it.

`disk`: every server reloads the checkpoint directory (`/update_weights_from_disk`; SGLang needs no
pause or session for it: the load waits for the requests in flight, then flushes the idle cache).
`nccl`: a broadcast group (trainer = rank 0, then each server's TP ranks) is set up once through
`/init_weights_update_group`; each version is sent as buckets of HF-named tensors, each bucket
announced by `/update_weights_from_distributed` WHILE rank 0 broadcasts it (the server's handler
blocks in the matching receives, so the HTTP call and the broadcast must overlap: the admin calls
run on an event loop in a background thread). Backend `gloo` on CPU, `nccl` on GPU.

One version over the group follows SGLang's protocol (docs/inference.md, "Weight updates"):
pause (mode `retract`: no token is generated from half-updated weights, and the cache can be
flushed) -> `/begin_weight_update` -> the buckets (`flush_cache: false` and no version, the last one
with the version and `flush_cache: true`) -> `/end_weight_update` -> `/continue_generation`. The
end and the continue run even when a step failed, so a failed update never leaves a server paused
or its session open. Every step has the publish deadline; errors name the step and the servers.

The trainer announces the version (`state/weight_version.json`, via `pipeline.weight_version`) only
after every server confirmed it; a server that fails is named in the error (`EngineError` lists
them). With no server registered (the trainer run alone, a test or a rerun) the version file is
still written and the log says that no server was updated. Publication runs on rank 0 only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from pipeline.engine.net import free_port
from pipeline.engine.weight_group import broadcast_from_trainer, destroy_weight_group, dtype_name, init_weight_group
from pipeline.errors import ArlError
from pipeline.handoff import write_json_atomic
from pipeline.paths import RunPaths
from pipeline.trainer.checkpoint import buckets

log = logging.getLogger("arl.trainer.publish")
T = TypeVar("T")
GROUP_NAME = "arl-weights"
"""Prefix of the broadcast group's name; each group gets a fresh suffix, because torch keeps a process's
group names until the group is destroyed: a server still holding the group of an earlier trainer (one that
crashed, or an `arl stage train --step N` redo) could not join a new group of the same name."""
BUCKET_BYTES = 256 * 1024**2


class Publisher(Protocol):
    def publish(self, version: int, checkpoint: Path | None, state_dict: dict[str, torch.Tensor] | None) -> list[str]:
        """Put `version` on every registered server; return their URLs (empty when none is registered)."""
        ...

    def close(self) -> None: ...


def make_publisher(kind: str, paths: RunPaths, timeout_s: float, tied_embeddings: bool) -> Publisher:
    if kind == "disk":
        return DiskPublisher(paths, timeout_s)
    if kind == "nccl":
        return BroadcastPublisher(paths, timeout_s, tied_embeddings)
    raise ValueError(f"unknown trainer.weight_sync {kind!r}; valid: disk, nccl")


class AsyncRunner:
    """An event loop in a daemon thread: lets blocking code (the broadcast) overlap async HTTP calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="arl-publish-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return self.submit(coro).result(timeout=timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class _ClientOwner:
    """Owns one EngineClient living on the runner's loop, pointed at the registry (re-read per call)."""

    def __init__(self, paths: RunPaths, timeout_s: float) -> None:
        from pipeline.engine.client import EngineClient
        from pipeline.engine.registry import urls_from_registry

        self.paths = paths
        self.timeout_s = timeout_s
        self.urls = urls_from_registry(paths)
        self.runner = AsyncRunner()
        self.client = EngineClient(self.urls, request_timeout_s=timeout_s, health_interval_s=0)
        self.runner.run(self.client.start(), timeout_s)

    def call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        return self.wait(self.runner.submit(coro), what)

    def wait(self, future: concurrent.futures.Future[T], what: str) -> T:
        """The result of an admin call, within the publish deadline (then it is cancelled)."""
        try:
            return future.result(timeout=self.timeout_s)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise ArlError(
                f"{what} not confirmed within trainer.publish_timeout_s={self.timeout_s:.0f}s by servers "
                f"{self.urls()}; see logs/inference/ (raise the timeout for big models)"
            ) from None

    @contextlib.contextmanager
    def afterwards(self, step: Callable[[], Coroutine[Any, Any, Any]], what: str) -> Iterator[None]:
        """Run `step` after the block, also when the block failed (then a failing `step` is logged, so
        the block's error is the one raised)."""
        try:
            yield
        except BaseException:
            try:
                self.call(step(), what)
            except Exception as exc:  # the block's error says what went wrong first
                log.error("%s after a failed publication failed too: %s", what, exc)
            raise
        self.call(step(), what)

    def close(self) -> None:
        try:
            self.runner.run(self.client.close(), 30)
        finally:
            self.runner.close()


class DiskPublisher:
    """Servers reload the checkpoint directory the trainer just wrote."""

    def __init__(self, paths: RunPaths, timeout_s: float) -> None:
        self.owner = _ClientOwner(paths, timeout_s)

    def publish(self, version: int, checkpoint: Path | None, state_dict: dict[str, torch.Tensor] | None) -> list[str]:
        if checkpoint is None:
            raise ValueError("disk weight sync needs a checkpoint for every version")
        urls = self.owner.urls()
        if not urls:
            log.info("version %d: no inference server registered; none was updated", version)
            return []
        self.owner.call(self.owner.client.update_weights_from_disk(str(checkpoint.resolve()), version),
                        f"/update_weights_from_disk of version {version}")  # fmt: skip
        return urls

    def close(self) -> None:
        self.owner.close()


class BroadcastPublisher:
    """Bucketed broadcast over a process group shared with the servers (gloo on CPU, nccl on GPU)."""

    def __init__(self, paths: RunPaths, timeout_s: float, tied_embeddings: bool) -> None:
        self.owner = _ClientOwner(paths, timeout_s)
        self.paths = paths
        self.tied = tied_embeddings
        self.group: Any = None
        self.group_name = ""
        self.members: list[str] = []
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")

    def publish(self, version: int, checkpoint: Path | None, state_dict: dict[str, torch.Tensor] | None) -> list[str]:
        if state_dict is None:
            raise ValueError("nccl weight sync needs the full state dict on rank 0")
        urls = self.owner.urls()
        if not urls:
            log.info("version %d: no inference server registered; none was updated", version)
            return []
        if self.group is None:
            self._setup(urls)
        elif sorted(urls) != sorted(self.members):
            raise ArlError(
                f"the inference servers changed since the weight broadcast group was set up (was {self.members}, "
                f"now {urls}); restart the trainer (it resumes exactly) or use trainer.weight_sync=disk"
            )
        tensors = {k: v for k, v in state_dict.items() if not (self.tied and k == "lm_head.weight")}
        self._send_version(version, buckets(tensors, BUCKET_BYTES))
        return urls

    def _send_version(self, version: int, parts: list[dict[str, torch.Tensor]]) -> None:
        """pause (retract) -> begin -> buckets -> end -> continue; end and continue also after a failure."""
        client, owner = self.owner.client, self.owner
        with owner.afterwards(client.continue_generation, f"/continue_generation after version {version}"):
            owner.call(client.pause_generation("retract"), f"/pause_generation (retract) before version {version}")
            with owner.afterwards(client.end_weight_update, f"/end_weight_update of version {version}"):
                owner.call(client.begin_weight_update(), f"/begin_weight_update of version {version}")
                for i, bucket in enumerate(parts):
                    last = i == len(parts) - 1
                    self._send(bucket, version if last else None, version, f"bucket {i + 1}/{len(parts)}")

    def _setup(self, urls: list[str]) -> None:
        """Join as rank 0 (the engine's own `init_weight_group`, SGLang-compatible) while every server joins
        through `/init_weights_update_group`."""
        address = "127.0.0.1" if all(_is_loopback(u) for u in urls) else socket.gethostbyname(socket.getfqdn())
        port = free_port("0.0.0.0")  # the store listens on every interface: the port must be free on all
        world = self.owner.call(self.owner.client.weights_group_world_size(), "/server_info")
        name = f"{GROUP_NAME}-{uuid.uuid4().hex[:8]}"
        write_json_atomic(self.paths.weight_sync, {"master_address": address, "master_port": port,
                                                   "group_name": name, "backend": self.backend,
                                                   "world_size": world, "created_at": time.time()})  # fmt: skip
        joined = self.owner.runner.submit(self.owner.client.init_weights_update_group(address, port, name,
                                                                                      self.backend))  # fmt: skip
        self.group = init_weight_group(address, port, rank=0, world_size=world, group_name=name,
                                       backend=self.backend, timeout_s=self.owner.timeout_s)  # fmt: skip
        self.group_name = name
        self.owner.wait(joined, "/init_weights_update_group")
        self.members = list(urls)
        log.info("weight broadcast group %s ready: %s world %d at %s:%d", name, self.backend, world, address, port)

    def _send(self, bucket: dict[str, torch.Tensor], announce: int | None, version: int, which: str) -> None:
        """One bucket: the servers' receive (HTTP) and rank 0's broadcast, overlapping. Only the last bucket
        `announce`s the version and flushes: SGLang records the version when a bucket loads."""
        names = list(bucket)
        dtypes = [dtype_name(t.dtype) for t in bucket.values()]
        shapes = [list(t.shape) for t in bucket.values()]
        update = self.owner.client.update_weights_from_distributed(
            names, dtypes, shapes, self.group_name, announce, flush_cache=announce is not None
        )
        confirmed = self.owner.runner.submit(update)
        what = f"/update_weights_from_distributed of version {version}, {which}"
        try:
            broadcast_from_trainer(self.group, [t.to(self.device) for t in bucket.values()])
        except Exception as exc:
            if confirmed.done() and confirmed.exception() is not None:
                raise ArlError(f"{what}: the broadcast failed ({exc}) after the servers refused: "
                               f"{confirmed.exception()}") from exc  # fmt: skip
            raise
        self.owner.wait(confirmed, what)

    def close(self) -> None:
        """Leave the group on both sides: the servers outlive this trainer, and a group they kept would hold
        its ranks and name there (best effort: a server that is gone has nothing to free)."""
        if self.group is not None:
            try:
                self.owner.call(self.owner.client.destroy_weights_update_group(self.group_name),
                                f"/destroy_weights_update_group {self.group_name}")  # fmt: skip
            except Exception as exc:  # closing must not mask the trainer's own outcome
                log.warning("the servers did not leave weight group %s: %s", self.group_name, exc)
            destroy_weight_group(self.group)
            self.group = None
        self.owner.close()


def _is_loopback(url: str) -> bool:
    from urllib.parse import urlparse

    return (urlparse(url).hostname or "") in ("127.0.0.1", "localhost", "::1")
