"""A proxy for the fuzz suites, served from a daemon thread's event loop (schemathesis' tests are synchronous):
one `ProxyServer` in this process, or a pool of worker processes (`proxy.workers`, `pipeline.proxy.pool`).

`make fuzz` sets ARL_FUZZ_POOL=1, and the suites then run every case against both (`WORKERS`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import httpx

WORKERS = [1, 2] if os.environ.get("ARL_FUZZ_POOL") == "1" else [1]


class ThreadedProxy:
    """A ProxyServer + EngineClient on an event loop in a daemon thread; with `workers` > 1 a pool of worker
    processes (`pipeline.proxy.pool`) driven from that thread instead."""

    def __init__(self, model_dir: Path, engine_url: str, workers: int = 1) -> None:
        self.model_dir, self.engine_url, self.workers = model_dir, engine_url, workers
        self.ready = threading.Event()
        self.url = ""
        self.urls: list[str] = []
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._error: BaseException | None = None

    async def _main(self) -> None:
        from pipeline.engine.client import EngineClient
        from pipeline.proxy.server import ProxyServer
        from schemas.config.model import ModelConfig
        from schemas.config.proxy import ProxyConfig

        model = ModelConfig(path=str(self.model_dir), max_context=512)
        config = ProxyConfig(max_tokens_limit=2, max_request_bytes=64 * 1024, max_sessions=100_000,
                             client_keys=["fuzz-client"], workers=self.workers)  # fmt: skip
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self.workers > 1:
            await self._serve_pool(model, config)
            return
        try:
            engine = EngineClient([self.engine_url], health_interval_s=0)
            proxy = ProxyServer(model, config, engine, admin_key="admin")
            self.urls = [await proxy.start()]
            self.url = self.urls[0]
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self.ready.set()
        await self._stop.wait()
        await proxy.stop()
        await engine.close()

    async def _serve_pool(self, model: Any, config: Any) -> None:
        from pipeline.proxy.pool import open_pool

        assert self._stop is not None
        try:
            async with (
                httpx.AsyncClient() as http,
                open_pool(model, config, admin_key="admin", http=http, engine_urls=[self.engine_url]) as (pool, _),
            ):
                self.urls, self.url = pool.urls, pool.urls[0]
                self.ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self.ready.set()

    def next_url(self) -> str:
        """The workers in turn (one URL without a pool): sessions and admin calls are spread over all of them."""
        self._next += 1
        return self.urls[self._next % len(self.urls)]

    def start(self) -> ThreadedProxy:
        self._thread.start()
        self.ready.wait(120)
        if self._error is not None or not self.url:
            raise RuntimeError(f"fuzz proxy did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
