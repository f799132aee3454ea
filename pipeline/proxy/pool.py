"""Several proxy workers on one host (`proxy.workers`): N processes, N ports, sessions pinned to their worker.

One proxy process is one core: its per-request work (HTTP parsing, chat templates, tokenizing, JSON)
runs in one event loop. A pool runs N `ProxyServer` processes, worker k on its own port. Why N ports
and not one shared listener: a session's conversation tree, its parent matching and its calls in
flight live in the memory of one process, and a shared listener hands connections, not sessions, to
workers (an agent's keep-alive connection carries the calls of many sessions). So:

* **Pinned.** A session lives on the worker that started it, and that worker's index is written into
  its id (`SessionStore.worker`). The control of this module (`PoolControl`) starts sessions round-robin
  and sends every later control call to the owner; agents get the owner's URL with their session
  (`SessionInfo.url`). A session key presented to another worker answers 421 naming the owner, never a
  silent 401 or a second tree.
* **Counted once.** Granted slots, open and started sessions are one shared-memory array
  (`pipeline.proxy.capacity`): `/grant_capacity` through any worker, or from this process, feeds the
  same pool of slots, and `max_sessions` bounds all workers together.
* **Ends announced here.** Each worker forwards its sessions' ends (end call, finalize, idle timeout)
  to this process over a Unix socket and answers the end call only once this process's subscriber has
  handled it, e.g. exported the session from the worker and written it to the spool. So the
  durability rule of the standalone proxy stage holds unchanged: a 2xx end call means the session
  is on disk.

The workers are children of this process (spawned, not forked: this process may hold threads and
CUDA-free but large state). Each exits when its pipe to this process closes, so a killed stage leaves
no worker behind, and this process stops with an error naming the worker if one dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from pipeline.engine.client.coalesce import BatchPolicy
from pipeline.errors import ArlError
from pipeline.proxy.capacity import Capacity, new_shared_counts
from pipeline.proxy.control import ExportedSession, HttpControl, SessionInfo
from pipeline.proxy.pool_worker import WorkerSpec, serve_worker
from pipeline.proxy.sessions import EndHook, SessionEnd, worker_of
from schemas.api.rl import SamplingOverride
from schemas.config.model import ModelConfig
from schemas.config.proxy import ProxyConfig

log = logging.getLogger("arl.proxy.pool")

START_TIMEOUT_S = 120.0
"""How long a worker may take to load its tokenizer and listen."""
STOP_TIMEOUT_S = 15.0


class PoolControl:
    """`ProxyControl` over a pool: starts go round-robin, every other call goes to the session's worker over HTTP
    (admin key); grants go straight to the shared counts. An export waits up to `export_wait_s` for calls in
    flight, as `LocalControl`'s does."""

    def __init__(
        self,
        urls: list[str],
        admin_key: str,
        http: httpx.AsyncClient,
        capacity: Capacity,
        *,
        export_wait_s: float = 30.0,
    ) -> None:
        self.urls = urls
        self.workers = [HttpControl(url, admin_key, http, export_wait_s=export_wait_s) for url in urls]
        self.capacity = capacity
        self._next = 0

    def _owner(self, session_id: str) -> HttpControl:
        index = worker_of(session_id)
        if index is None or index >= len(self.workers):
            return self.workers[0]  # not a pool id: the worker answers 404 naming it
        return self.workers[index]

    async def grant_capacity(self, count: int = 1) -> None:
        self.capacity.grant(count)

    async def start_session(
        self,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling: SamplingOverride | None = None,
    ) -> SessionInfo:
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        info = await worker.start_session(group_id, metadata, sampling)
        return SessionInfo(info.session_id, info.api_key, url=worker.url)

    async def set_reward(self, session_id: str, reward: float, interaction_id: str | None = None) -> None:
        await self._owner(session_id).set_reward(session_id, reward, interaction_id)

    async def end_session(self, session_id: str, status: str | None = None) -> None:
        await self._owner(session_id).end_session(session_id, status)

    async def export(self, session_id: str, *, style: str, discount: float) -> ExportedSession:
        return await self._owner(session_id).export(session_id, style=style, discount=discount)


@dataclass
class _Worker:
    index: int
    process: Any
    conn: Any
    url: str = ""


class ProxyPool:
    """The worker processes of one pool (see the module docstring); `open_pool` is the way to run one."""

    def __init__(
        self,
        model: ModelConfig,
        proxy: ProxyConfig,
        *,
        admin_key: str,
        engine_urls: list[str] | None = None,
        run_root: str | None = None,
        request_timeout_s: float = 600.0,
        on_end: EndHook | None = None,
        adapters: bool = False,
        batching: BatchPolicy | None = None,
    ) -> None:
        self.model, self.proxy, self.admin_key = model, proxy, admin_key
        self.adapters = adapters
        """Name the announced version's LoRA adapter in every request (`weight_version.AnnouncedAdapter`)."""
        self.engine_urls, self.run_root, self.request_timeout_s = engine_urls, run_root, request_timeout_s
        self.on_end = on_end
        self.batching = batching or BatchPolicy()
        """How the workers' engine clients batch completions (`inference.batch_window_ms`)."""
        self.context = multiprocessing.get_context("spawn")
        self.capacity = Capacity(new_shared_counts(self.context))
        self.workers: list[_Worker] = []
        self.events_path: str | None = None
        self._events: asyncio.AbstractServer | None = None
        self._watch: asyncio.Task[None] | None = None
        self.error: str | None = None

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    async def start(self) -> list[str]:
        """Spawn the workers and return their URLs once every one listens (an error names a worker that did not)."""
        if self.on_end is not None:
            self.events_path = os.path.join(tempfile.mkdtemp(prefix="arl-proxy-"), "ends.sock")
            self._events = await asyncio.start_unix_server(self._serve_end, path=self.events_path)
            os.chmod(self.events_path, 0o600)
        for index in range(self.proxy.workers):
            port = self.proxy.port + index if self.proxy.port else 0
            spec = WorkerSpec(
                index=index,
                model=self.model.model_dump(),
                proxy=self.proxy.model_copy(update={"port": port}).model_dump(),
                admin_key=self.admin_key,
                engine_urls=self.engine_urls,
                run_root=self.run_root,
                request_timeout_s=self.request_timeout_s,
                events_path=self.events_path,
                log_level=logging.getLogger().level,
                adapters=self.adapters,
                batching=self.batching,
            )
            parent, child = self.context.Pipe()
            process = self.context.Process(
                target=serve_worker,
                args=(spec, self.capacity.shared, child),
                name=f"arl-proxy-worker-{index}",
                daemon=True,
            )
            process.start()
            child.close()
            self.workers.append(_Worker(index, process, parent))
        for worker in self.workers:
            worker.url = await asyncio.to_thread(_await_url, worker, START_TIMEOUT_S)
        self._watch = asyncio.create_task(self._watch_workers(), name="proxy-pool-watch")
        log.info("proxy pool of %d workers: %s", len(self.workers), ", ".join(self.urls))
        return self.urls

    def check(self) -> None:
        """Raise if a worker has died (its sessions are lost with it: the stage must stop and be restarted)."""
        if self.error is not None:
            raise ArlError(self.error)

    async def _watch_workers(self) -> None:
        while self.error is None:
            for worker in self.workers:
                if not worker.process.is_alive():
                    self.error = (
                        f"proxy worker {worker.index} ({worker.url}, pid {worker.process.pid}) exited "
                        f"with code {worker.process.exitcode}: its sessions are lost; see this stage's "
                        "log"
                    )
                    log.error("%s", self.error)
            await asyncio.sleep(0.5)

    async def _serve_end(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One end event from a worker: run the subscriber, answer `ok` or the error (the worker's end call then
        answers 503)."""
        assert self.on_end is not None
        try:
            event = SessionEnd(**json.loads(await reader.readline()))
            try:
                await self.on_end(event)
                reply: dict[str, Any] = {"ok": True}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, ValueError, TypeError) as exc:  # a worker gone, or a malformed line (a bug)
            log.error("a proxy worker's session-end event failed: %s", exc)
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for worker in self.workers:
            with contextlib.suppress(OSError):
                worker.conn.send("stop")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self.workers:
            await asyncio.to_thread(worker.process.join, max(deadline - time.monotonic(), 0.1))
            if worker.process.is_alive():
                log.warning("proxy worker %d did not stop in %gs; killing it", worker.index, STOP_TIMEOUT_S)
                worker.process.kill()
                await asyncio.to_thread(worker.process.join, 5.0)
            worker.conn.close()
        if self._events is not None:
            self._events.close()
            await self._events.wait_closed()
        if self.events_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.events_path)
                os.rmdir(os.path.dirname(self.events_path))


def _await_url(worker: _Worker, timeout_s: float) -> str:
    """The URL a worker reports once it listens (blocking; run in a thread)."""
    deadline = time.monotonic() + timeout_s
    while not worker.conn.poll(0.2):
        if not worker.process.is_alive():
            raise ArlError(
                f"proxy worker {worker.index} exited with code {worker.process.exitcode} before it "
                "listened; its error is in this stage's log above"
            )
        if time.monotonic() > deadline:
            raise ArlError(
                f"proxy worker {worker.index} (pid {worker.process.pid}) did not listen within {timeout_s:g}s"
            )
    message = worker.conn.recv()
    if not isinstance(message, str) or not message.startswith("http"):
        raise ArlError(f"proxy worker {worker.index} failed to start: {message}")
    return message


@contextlib.asynccontextmanager
async def open_pool(
    model: ModelConfig, proxy: ProxyConfig, *, admin_key: str, http: httpx.AsyncClient, **kwargs: Any
) -> AsyncIterator[tuple[ProxyPool, PoolControl]]:
    """A started pool and its control; the workers are stopped on exit. `kwargs`: `ProxyPool`'s."""
    pool = ProxyPool(model, proxy, admin_key=admin_key, **kwargs)
    try:
        urls = await pool.start()
        yield pool, PoolControl(urls, admin_key, http, pool.capacity)
    finally:
        await pool.stop()
