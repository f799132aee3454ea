"""What a rollout or standalone-proxy job runs beside its loop: the engine client and the proxy.

`open_services` waits (with a deadline) for the inference servers to register, starts the proxy
in this process (or, with `proxy.workers` > 1, a pool of worker processes: `pipeline.proxy.pool`),
publishes `registry/proxy/<name>.json` (URLs, host, pid, never a key) and yields the proxy's control:
in process `pipeline.proxy.local.LocalControl` (the session store, called directly), for a pool
`PoolControl` (each session's worker over HTTP). Agents reach the proxy over HTTP at its URL. The
admin key, which only operators use (over HTTP), comes from `proxy.admin_key` or is generated and
kept in `state/proxy_admin_key` (mode 600).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from pipeline.run.handoff import fsync_dir, wait_for, write_json_atomic
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig

if TYPE_CHECKING:
    from pipeline.engine.client import EngineClient
    from pipeline.engine.client.coalesce import BatchPolicy
    from pipeline.proxy.control import ProxyControl
    from pipeline.proxy.local import LocalControl
    from pipeline.proxy.pool import PoolControl
    from pipeline.proxy.server import ProxyServer
    from pipeline.proxy.sessions import EndHook, SessionEnd

log = logging.getLogger("arl.rollout")


@dataclass
class Services:
    engine: EngineClient
    """Over the registered inference servers."""
    control: LocalControl | PoolControl
    """The proxy's sessions: driven in this process, or over HTTP to the pool's workers."""
    proxy_url: str
    http: httpx.AsyncClient
    """For inline agents' calls to the proxy (shared: connection reuse)."""
    urls: list[str]
    """Every proxy process's URL (one unless `proxy.workers` > 1); a session's own is `SessionInfo.url`."""
    check: Callable[[], None] = lambda: None
    """Raises if a proxy worker died (a pool's sessions would be lost with it)."""


def admin_key_for(config: ArlConfig, paths: RunPaths) -> str:
    """`proxy.admin_key`, else the key kept in the run dir, else a new one (saved with mode 600)."""
    if config.proxy.admin_key:
        return config.proxy.admin_key
    path = paths.proxy_admin_key
    if path.exists():
        return path.read_text().strip()
    key = "arl-admin-" + secrets.token_urlsafe(24)
    _write_secret(path, key)
    return key


def _write_secret(path: Path, text: str) -> None:
    """Atomic like `write_text_atomic`, but never world-readable, not even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


async def wait_for_servers(paths: RunPaths, timeout_s: float) -> list[str]:
    """The registered inference URLs, waiting for the first one (the error names the inference stage)."""
    from pipeline.engine.registry import urls_from_registry

    urls = urls_from_registry(paths)
    found = await asyncio.to_thread(
        wait_for,
        lambda: urls() or None,
        what=f"an inference server entry in {paths.inference_registry}",
        upstream="inference",
        log=paths.latest_log("inference"),
        timeout_s=timeout_s,
    )
    return list(found) if isinstance(found, list) else urls()


def batching(config: ArlConfig) -> BatchPolicy:
    """The engine client's request batching (`inference.batch_window_ms`)."""
    from pipeline.engine.client.coalesce import BatchPolicy

    return BatchPolicy(config.inference.batch_window_ms / 1000, config.inference.max_batch_size)


def registry_entry(urls: list[str]) -> dict[str, Any]:
    """`url`: the first worker's (any one serves whole sessions); `urls`: every worker's (`proxy.workers`)."""
    return {
        "url": urls[0],
        "urls": urls,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


@contextlib.asynccontextmanager
async def open_services(
    config: ArlConfig, paths: RunPaths, *, name: str, subscribe: Callable[[ProxyControl], EndHook] | None = None
) -> AsyncIterator[Services]:
    """Engine client + the proxy (listening once this yields: in this process, or a pool of `proxy.workers`
    processes) + its registry entry; all closed/removed on exit. `subscribe(control)` returns a hook for the
    proxy's session ends (`SessionStore.on_end`), subscribed before the proxy listens, so that no end is missed."""
    from pipeline.engine.client import EngineClient
    from pipeline.engine.registry import urls_from_registry
    from pipeline.run.weight_version import announced_adapter

    engine = EngineClient(
        urls_from_registry(paths),
        request_timeout_s=config.inference.request_timeout_s,
        adapter=announced_adapter(config, paths),
        batching=batching(config),
    )
    # Built before the wait: the proxy's tokenizer and chat template (about 2 s, mostly importing transformers)
    # load while the inference stage is still loading its model, instead of after. The engine client reads
    # the registry again on its first request.
    proxy = _in_process_proxy(config, paths, engine) if config.proxy.workers == 1 else None
    await wait_for_servers(paths, config.inference.startup_timeout_s)
    await engine.start()
    entry = paths.proxy_entry(name)
    try:
        if proxy is None:
            opened = _open_pool(config, paths, engine, subscribe)
        else:
            opened = _open_in_process(config, proxy, engine, subscribe)
        async with opened as services:
            write_json_atomic(entry, registry_entry(services.urls))
            log.info("proxy %s serving at %s (registry entry %s)", name, ", ".join(services.urls), entry)
            yield services
    finally:
        entry.unlink(missing_ok=True)
        await engine.close()


def _in_process_proxy(config: ArlConfig, paths: RunPaths, engine: EngineClient) -> ProxyServer:
    from pipeline.proxy.server import ProxyServer

    return ProxyServer(config.model, config.proxy, engine, admin_key=admin_key_for(config, paths))


@contextlib.asynccontextmanager
async def _open_in_process(
    config: ArlConfig, proxy: ProxyServer, engine: EngineClient, subscribe: Callable[[ProxyControl], EndHook] | None
) -> AsyncIterator[Services]:
    if subscribe is not None:
        proxy.store.on_end(subscribe(proxy.control))
    http = None
    try:
        url = await proxy.start()
        http = agent_http_client(
            config.rollout.run_timeout_s + 60,
            proxy_url=url,
            proxy_app=proxy.app,
            transport=config.rollout.agent_transport,
        )
        yield Services(engine=engine, control=proxy.control, proxy_url=url, http=http, urls=[url])
    finally:
        if http is not None:
            await http.aclose()
        await proxy.stop()


@contextlib.asynccontextmanager
async def _open_pool(
    config: ArlConfig, paths: RunPaths, engine: EngineClient, subscribe: Callable[[ProxyControl], EndHook] | None
) -> AsyncIterator[Services]:
    """`proxy.workers` processes (`pipeline.proxy.pool`); their ends, if subscribed, handled in this process."""
    from pipeline.proxy.pool import open_pool

    http = agent_http_client(config.rollout.run_timeout_s + 60, transport="http")
    hook: list[EndHook] = []
    subscribed = asyncio.Event()

    async def on_end(event: SessionEnd) -> None:
        await subscribed.wait()  # an end can reach us between the workers listening and `subscribe` below
        await hook[0](event)

    try:
        async with open_pool(
            config.model,
            config.proxy,
            admin_key=admin_key_for(config, paths),
            http=http,
            run_root=str(paths.root),
            request_timeout_s=config.inference.request_timeout_s,
            batching=batching(config),
            on_end=on_end if subscribe is not None else None,
            adapters=engine.adapter is not None,
        ) as (pool, control):
            if subscribe is not None:
                hook.append(subscribe(control))
                subscribed.set()
            yield Services(
                engine=engine, control=control, proxy_url=pool.urls[0], http=http, urls=pool.urls, check=pool.check
            )
    finally:
        await http.aclose()


def agent_http_client(
    timeout_s: float, *, proxy_url: str | None = None, proxy_app: Any = None, transport: str = "in_process"
) -> httpx.AsyncClient:
    """The `http_client` offered to inline agents (shared by every run, so connections are reused): an httpx
    client (what the OpenAI SDK takes). With `transport` "in_process" (`rollout.agent_transport`), requests to
    `proxy_url` are handed to `proxy_app` in process (`pipeline.proxy.inprocess`); all others go over an aiohttp
    transport. Why aiohttp: httpcore's pool rescans every pooled connection (a socket poll each) whenever a
    request starts or ends, so with 64 runs in flight one shared pool cost ~6 ms of CPU per request in the
    rollout's event loop, half of it there; aiohttp's pool does not. No connection limit: `rollout.max_concurrency`
    bounds the runs."""
    import aiohttp
    from httpx_aiohttp import AiohttpTransport

    from pipeline.proxy.inprocess import InProcessTransport

    network = AiohttpTransport(client=lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
    mounts: dict[str, httpx.AsyncBaseTransport] = {}
    if transport == "in_process" and proxy_url is not None and proxy_app is not None:
        mounts[proxy_url.rstrip("/")] = InProcessTransport(proxy_app)
    return httpx.AsyncClient(transport=network, mounts=mounts, timeout=httpx.Timeout(timeout_s))
