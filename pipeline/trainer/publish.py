"""Weight publication: get version v onto every registered inference server, then announce it.

`disk`: every server reloads the checkpoint directory (`/update_weights_from_disk`).
`nccl`: a broadcast group (trainer = rank 0, then each server's TP ranks) is set up once through
`/init_weights_update_group`; each version is sent as buckets of HF-named tensors, each bucket
announced by `/update_weights_from_distributed` WHILE rank 0 broadcasts it (the server's handler
blocks in the matching receives, so the HTTP call and the broadcast must overlap: the admin calls
run on an event loop in a background thread). Backend `gloo` on CPU, `nccl` on GPU.

The trainer announces the version (`state/weight_version.json`, via `pipeline.weight_version`) only
after every server confirmed it; a server that fails is named in the error (`EngineError` lists
them). With no server registered (the trainer run alone, a test or a rerun) the version file is
still written and the log says that no server was updated. Publication runs on rank 0 only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Coroutine
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
        try:
            return self.runner.run(coro, self.timeout_s)
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise ArlError(
                f"{what} not confirmed within trainer.publish_timeout_s={self.timeout_s:.0f}s by servers "
                f"{self.urls()}; see logs/inference/ (raise the timeout for big models)"
            ) from None

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
        for bucket in buckets(tensors, BUCKET_BYTES):
            self._send(bucket, version)
        return urls

    def _setup(self, urls: list[str]) -> None:
        """Join as rank 0 (the engine's own `init_weight_group`, SGLang-compatible) while every server joins
        through `/init_weights_update_group`."""
        address = "127.0.0.1" if all(_is_loopback(u) for u in urls) else socket.gethostbyname(socket.getfqdn())
        port = free_port("0.0.0.0")  # the store listens on every interface: the port must be free on all
        world = self.owner.call(self.owner.client.weights_group_world_size(), "/get_server_info")
        write_json_atomic(self.paths.weight_sync, {"master_address": address, "master_port": port,
                                                   "group_name": GROUP_NAME, "backend": self.backend,
                                                   "world_size": world, "created_at": time.time()})  # fmt: skip
        joined = self.owner.runner.submit(self.owner.client.init_weights_update_group(address, port, GROUP_NAME,
                                                                                      self.backend))  # fmt: skip
        self.group = init_weight_group(address, port, rank=0, world_size=world, group_name=GROUP_NAME,
                                       backend=self.backend, timeout_s=self.owner.timeout_s)  # fmt: skip
        joined.result(timeout=self.owner.timeout_s)
        self.members = list(urls)
        log.info(
            "weight broadcast group %s ready: %s world %d at %s:%d", GROUP_NAME, self.backend, world, address, port
        )

    def _send(self, bucket: dict[str, torch.Tensor], version: int) -> None:
        names = list(bucket)
        dtypes = [dtype_name(t.dtype) for t in bucket.values()]
        shapes = [list(t.shape) for t in bucket.values()]
        confirmed = self.owner.runner.submit(
            self.owner.client.update_weights_from_distributed(names, dtypes, shapes, GROUP_NAME, version)
        )
        broadcast_from_trainer(self.group, [t.to(self.device) for t in bucket.values()])
        try:
            confirmed.result(timeout=self.owner.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ArlError(f"/update_weights_from_distributed of version {version} not confirmed within "
                           f"{self.owner.timeout_s:.0f}s by {self.members}") from None  # fmt: skip

    def close(self) -> None:
        if self.group is not None:
            destroy_weight_group(self.group)
            self.group = None
        self.owner.close()


def _is_loopback(url: str) -> bool:
    from urllib.parse import urlparse

    return (urlparse(url).hostname or "") in ("127.0.0.1", "localhost", "::1")
