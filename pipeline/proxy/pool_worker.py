"""One worker process of a proxy pool (`pipeline.proxy.pool`): a `ProxyServer` on its own port.

Runs in a spawned child. It builds its own engine client and tokenizer, counts sessions in the pool's
shared array, reports its URL on the pipe to the parent, and serves until the parent says stop or
goes away (the pipe reaches end of file). Its sessions' ends are forwarded to the parent
(`EndForwarder`) when the parent subscribes to them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from pipeline.engine.client.coalesce import BatchPolicy
from pipeline.proxy.sessions import SessionEnd

log = logging.getLogger("arl.proxy.pool")

END_TIMEOUT_S = 600.0
"""How long a worker waits for the parent to handle one session's end (an export and a spool write)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs, in picklable form."""

    index: int
    model: dict[str, Any]
    proxy: dict[str, Any]
    admin_key: str
    engine_urls: list[str] | None
    """Fixed inference URLs, or None to follow the run's registry under `run_root`."""
    run_root: str | None
    request_timeout_s: float
    events_path: str | None
    """The parent's Unix socket for session ends; None when nobody subscribes."""
    log_level: int
    adapters: bool = False
    """Requests name the announced version's LoRA adapter (read from the run under `run_root`)."""
    batching: BatchPolicy = dataclasses.field(default_factory=BatchPolicy)
    """How the engine client batches completions (`inference.batch_window_ms`)."""


class EndForwarder:
    """A session-end hook that hands the event to the pool's parent and returns once the parent has handled it
    (raising, so that the end call answers 503, if the parent reports a failure or does not answer)."""

    def __init__(self, path: str, worker: int) -> None:
        self.path = path
        self.worker = worker

    async def __call__(self, event: SessionEnd) -> None:
        try:
            reply = await asyncio.wait_for(self._send(event), END_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(
                f"the proxy stage did not acknowledge the end of session {event.session_id} within "
                f"{END_TIMEOUT_S:g}s (worker {self.worker})"
            ) from None
        except OSError as exc:
            raise RuntimeError(f"worker {self.worker} could not reach the proxy stage at {self.path}: {exc}") from exc
        if not reply.get("ok"):
            raise RuntimeError(str(reply.get("error") or "the proxy stage refused the session's end"))

    async def _send(self, event: SessionEnd) -> dict[str, Any]:
        reader, writer = await asyncio.open_unix_connection(self.path)
        try:
            writer.write(json.dumps(dataclasses.asdict(event)).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
        if not line:
            raise OSError("the proxy stage closed the connection without an answer")
        reply = json.loads(line)
        return reply if isinstance(reply, dict) else {}


def serve_worker(spec: WorkerSpec, counts: Any, conn: Any) -> None:
    """The child's entry point (`multiprocessing` target)."""
    from pipeline.run.logs import run_async, setup_logging

    setup_logging(level=logging.getLevelName(spec.log_level) if spec.log_level else None)
    try:
        run_async(_serve(spec, counts, conn))
    except Exception as exc:
        log.exception("proxy worker %d failed", spec.index)
        try:
            conn.send(f"error: {type(exc).__name__}: {exc}")
        except OSError:
            pass
        raise SystemExit(1) from exc


async def _serve(spec: WorkerSpec, counts: Any, conn: Any) -> None:
    from pathlib import Path

    from pipeline.engine.client import EngineClient
    from pipeline.engine.registry import urls_from_registry
    from pipeline.proxy.capacity import Capacity
    from pipeline.proxy.server import ProxyServer
    from pipeline.run.paths import RunPaths
    from pipeline.run.weight_version import AnnouncedAdapter
    from schemas.config.model import ModelConfig
    from schemas.config.proxy import ProxyConfig

    urls: Any = spec.engine_urls
    if urls is None:  # follow the run's registry, as the stage's own engine client does
        urls = urls_from_registry(RunPaths(Path(spec.run_root or ".")))
    adapter = AnnouncedAdapter(RunPaths(Path(spec.run_root or "."))) if spec.adapters else None
    engine = EngineClient(urls, request_timeout_s=spec.request_timeout_s, adapter=adapter, batching=spec.batching)
    proxy = ProxyServer(
        ModelConfig(**spec.model),
        ProxyConfig(**spec.proxy),
        engine,
        admin_key=spec.admin_key,
        capacity=Capacity(counts),
        worker=spec.index,
    )
    if spec.events_path is not None:
        proxy.store.on_end(EndForwarder(spec.events_path, spec.index))
    try:
        url = await proxy.start()
        conn.send(url)
        await _until_told_to_stop(conn)
    finally:
        await proxy.stop()
        await engine.close()


async def _until_told_to_stop(conn: Any) -> None:
    """Return when the parent sends anything or its end of the pipe closes (the parent is gone)."""
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(conn.fileno(), readable.set)
    try:
        await readable.wait()
    finally:
        loop.remove_reader(conn.fileno())
