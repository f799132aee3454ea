"""The engine client: one async object over N inference servers that speak SGLang's native protocol.

Used by the proxy (generation) and the trainer (weight publication). It talks to our `hf` server,
a real SGLang server, or the vLLM adapter the same way, because all of them serve `/generate`.

Routing. Each request goes to the healthy server with the fewest requests *this client* has in
flight there (true in-flight count, not round robin: agent turns vary by 100x in length). A
`sticky_key` (the proxy passes the session id) pins a session to the server that served it
first, so its growing prompt hits that server's prefix cache; the pin moves only when that
server fails.

Failure. A connection error (refused, reset, server gone) marks the server unhealthy and the
request is retried on another server; a 4xx is the caller's fault and is raised at once, never
retried. A background task re-checks `/health` every `health_interval_s` and re-reads the URL
list when it is a callable (the registry directory), so servers that come and go are followed.

LoRA adapters (`trainer.lora.publish: adapter`). With an `adapter` source, each request names the adapter of
the announced version (`lora_path`, SGLang's field), and its tokens are labelled with that adapter's version:
the adapter serves the request for its whole life on every engine, while SGLang's own `weight_version` is one
label for the whole server.

Cancellation. When the task awaiting a request is cancelled (the agent hung up), the client
tells the server to stop decoding it (`POST /abort_request {"rid"}`), so abandoned requests do not
hold batch slots. The same happens when the per-request timeout fires.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pipeline.engine.client.admin import AdminCalls
from pipeline.engine.client.coalesce import BatchPolicy, Coalescer
from pipeline.engine.client.wire import (
    EngineError,
    GenerateChunk,
    GenerateResult,
    Retryable,
    StreamState,
    check_single,
    check_top,
    chunk_from,
    raise_for_status,
    result_from,
    single_answer,
    sse_payloads,
)
from schemas.engine_api import lora_adapter_version

log = logging.getLogger("arl.engine.client")

_STICKY_CAPACITY = 65536  # sessions remembered; the oldest pins are forgotten first
_ABORT_TIMEOUT_S = 5.0
# Errors after which the same request can safely go to another server: the connection failed or
# the server vanished. Timeouts are not here: the server may still be generating.
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, ConnectionError)
# A body cut short (the server died mid-response) is a server failure too, not a caller error.
_STREAM_ERRORS = (*_CONNECTION_ERRORS, aiohttp.ClientPayloadError)
# Below uvicorn's/SGLang's 5 s keep-alive, so the client usually drops an idle connection first.
_KEEPALIVE_S = 2.0


@dataclass
class _Server:
    url: str
    inflight: int = 0
    healthy: bool = True
    last_error: str | None = None


class EngineClient(AdminCalls):
    """Async client over N inference servers (see the module docstring for routing and failure)."""

    def __init__(
        self,
        urls: list[str] | Callable[[], list[str]],
        *,
        request_timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
        adapter: Callable[[], str | None] | None = None,
        batching: BatchPolicy | None = None,
    ) -> None:
        self._url_source = urls
        self.batching = batching or BatchPolicy()
        """Non-streamed completions to one server gathered into batch requests (`pipeline.engine.client.coalesce`)."""
        self._coalescers: dict[str, Coalescer] = {}
        self.adapter = adapter
        """The LoRA adapter new requests name (`lora_path`), asked per request; None: the base model."""
        self.request_timeout_s = request_timeout_s
        self.health_interval_s = health_interval_s
        self._servers: dict[str, _Server] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._refresh_urls()

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the HTTP session and start the background health checks (idempotent)."""
        if self._session is None:
            # No total limit on connections: the proxy may hold hundreds of streams at once.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="engine-client-health")

    async def close(self) -> None:
        """Stop health checks, let pending aborts finish (briefly), close the session."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for coalescer in self._coalescers.values():
            await coalescer.close()
        if self._background:
            await asyncio.wait(self._background, timeout=_ABORT_TIMEOUT_S)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def urls(self) -> list[str]:
        return list(self._servers)

    def inflight(self) -> dict[str, int]:
        """Requests this client has in flight per server (for metrics and tests)."""
        return {url: server.inflight for url, server in self._servers.items()}

    # -- generation -------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        sticky_key: str | None = None,
        top_logprobs_num: int = 0,
    ) -> GenerateResult:
        """Generate one completion; fails over to another server on connection errors.

        `top_logprobs_num` > 0 is sent as SGLang's field of that name; the result then carries
        `output_top_logprobs` (one entry per output token, checked).
        """
        body = self._body(input_ids, sampling_params, stream=False, top_logprobs_num=top_logprobs_num)
        tried: list[str] = []
        while True:
            server = self._pick(sticky_key, exclude=tried)
            tried.append(server.url)
            try:
                data = await self._tracked(server, body["rid"], self._post_generate(server.url, body))
            except Retryable as exc:
                self._fail_over(server, sticky_key, tried, exc, streamed=None)
                continue
            result = result_from(data, server.url, top_logprobs_num)
            version = adapter_version(body)
            if version is not None:
                result.weight_version, result.output_versions = version, [version] * len(result.output_ids)
            return result

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        sticky_key: str | None = None,
        top_logprobs_num: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        """Yield increments as the server produces them (`top_logprobs_num` as in `generate`).

        Fails over only before the first chunk arrived: after that, tokens have reached the caller
        and a restart elsewhere would produce a different continuation.
        """
        body = self._body(input_ids, sampling_params, stream=True, top_logprobs_num=top_logprobs_num)
        tried: list[str] = []
        while True:
            server = self._pick(sticky_key, exclude=tried)
            tried.append(server.url)
            state = StreamState(top_logprobs_num=top_logprobs_num)
            inner = self._stream_from(server, body, state)
            try:
                version = adapter_version(body)
                async for chunk in inner:
                    if version is not None:
                        chunk.weight_version, chunk.new_versions = version, [version] * len(chunk.new_ids)
                    yield chunk
                return
            except Retryable as exc:
                self._fail_over(server, sticky_key, tried, exc, streamed=len(state.ids))
            finally:
                # The caller may stop iterating early: close the inner stream now so it aborts the
                # request on the server instead of whenever the generator is garbage collected.
                await inner.aclose()

    async def _stream_from(
        self, server: _Server, body: dict[str, Any], state: StreamState
    ) -> AsyncGenerator[GenerateChunk, None]:
        rid = body["rid"]
        server.inflight += 1
        # aiohttp's own deadline, not asyncio.timeout: a generator suspended at `yield` must not
        # cancel whatever the consumer's task is doing when the deadline passes.
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        try:
            async with self._http().post(f"{server.url}/generate", json=body, timeout=timeout) as resp:
                await raise_for_status(resp, server.url)
                async for payload in sse_payloads(resp):
                    chunk = chunk_from(payload, state)
                    if chunk is not None:
                        yield chunk
            check_top(state.ids, state.top, state.top_logprobs_num, server.url)
        except _STREAM_ERRORS as exc:
            raise Retryable(f"{type(exc).__name__}: {exc}") from exc
        except TimeoutError:
            raise self._timed_out(server, rid, "stream from") from None
        except (asyncio.CancelledError, GeneratorExit):
            self._abort_later(server.url, rid)
            raise
        finally:
            server.inflight -= 1

    def _timed_out(self, server: _Server, rid: str, what: str) -> EngineError:
        """Abort the request on the server (in the background) and say which deadline passed."""
        self._abort_later(server.url, rid)
        return EngineError(
            f"{what} {server.url} timed out after {self.request_timeout_s}s (raise inference.request_timeout_s?)",
            server=server.url,
        )

    def _body(
        self, input_ids: list[int], sampling_params: dict[str, Any], *, stream: bool, top_logprobs_num: int
    ) -> dict[str, Any]:
        check_single(sampling_params)
        body = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
            "stream": stream,
            "rid": uuid.uuid4().hex,
        }
        if top_logprobs_num:  # only when asked: the server then computes (and sends) the top-k
            body["top_logprobs_num"] = top_logprobs_num
        adapter = self.adapter() if self.adapter is not None else None
        if adapter is not None:
            body["lora_path"] = adapter
        return body

    async def _tracked(self, server: _Server, rid: str, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        """Count the request as in flight; abort it on the server if we are cancelled or time out."""
        server.inflight += 1
        try:
            async with asyncio.timeout(self.request_timeout_s):
                return await work
        except TimeoutError:
            raise self._timed_out(server, rid, "request to") from None
        except asyncio.CancelledError:
            self._abort_later(server.url, rid)
            raise
        finally:
            server.inflight -= 1

    async def _post_generate(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """One completion's answer: through the server's coalescer with `batch_window_s`, else on its own."""
        if self.batching.window_s > 0:
            coalescer = self._coalescers.get(url)
            if coalescer is None:
                coalescer = Coalescer(url, self._post, self.batching)
                self._coalescers[url] = coalescer
            return await coalescer.submit(body)
        return single_answer(await self._post(url, body), url)

    async def _post(self, url: str, body: dict[str, Any]) -> Any:
        """POST `/generate` (not streamed); the decoded answer, an object or a batch's list."""
        for attempt in (1, 2):
            try:
                async with self._http().post(f"{url}/generate", json=body) as resp:
                    await raise_for_status(resp, url)
                    data = await resp.json(content_type=None)
                break
            except aiohttp.ServerDisconnectedError as exc:
                # A pooled keep-alive connection the server closed while our loop was busy: the request
                # never reached it, so one retry on a fresh connection is safe and keeps a healthy server up.
                if attempt == 2:
                    raise Retryable(f"{type(exc).__name__}: {exc}") from exc
                log.debug("connection to %s was closed by the server; retrying once", url)
            except _CONNECTION_ERRORS as exc:
                raise Retryable(f"{type(exc).__name__}: {exc}") from exc
        return data

    # -- routing ----------------------------------------------------------------------------
    def _pick(self, sticky_key: str | None, exclude: list[str]) -> _Server:
        server = self._pick_or_none(sticky_key, exclude)
        if server is None:
            if not self._servers:
                raise EngineError(
                    "no inference servers known: is the inference stage running and has it "
                    "written registry/inference/*.json?"
                )
            states = {url: s.last_error or "excluded" for url, s in self._servers.items()}
            raise EngineError(f"no usable inference server: {states}")
        if sticky_key is not None:
            self._sticky[sticky_key] = server.url
            self._sticky.move_to_end(sticky_key)
            while len(self._sticky) > _STICKY_CAPACITY:
                self._sticky.popitem(last=False)
        return server

    def _pick_or_none(self, sticky_key: str | None, exclude: list[str]) -> _Server | None:
        if not self._servers:
            self._refresh_urls()
        candidates = [s for s in self._servers.values() if s.url not in exclude]
        if sticky_key is not None:
            pinned = self._servers.get(self._sticky.get(sticky_key, ""))
            if pinned is not None and pinned.healthy and pinned.url not in exclude:
                return pinned
        healthy = [s for s in candidates if s.healthy]
        # When every server looks down, try them anyway: the health view may be stale.
        pool = healthy or candidates
        if not pool:
            return None
        return min(pool, key=lambda s: s.inflight)

    def _fail_over(
        self, server: _Server, sticky_key: str | None, tried: list[str], exc: Retryable, *, streamed: int | None
    ) -> None:
        """Mark `server` down after a connection-level failure; raise unless the request may go elsewhere.

        `streamed`: tokens a stream already delivered (None: not a stream). Such a stream is never
        restarted: a restart elsewhere would produce a different continuation of tokens the caller has.
        """
        server.healthy = False
        server.last_error = str(exc)
        if sticky_key is not None:
            self._sticky.pop(sticky_key, None)
        if streamed or self._pick_or_none(sticky_key, exclude=tried) is None:
            message = (
                f"every inference server failed for this request; tried {tried}: {exc}"
                if streamed is None
                else f"stream from {server.url} failed after {streamed} tokens: {exc}"
            )
            raise EngineError(message, server=server.url) from exc
        log.warning("server %s failed (%s); retrying on another server", server.url, exc)

    def _refresh_urls(self) -> None:
        source = self._url_source
        urls = source() if callable(source) else source
        fresh = [u.rstrip("/") for u in urls]
        kept = {u: self._servers.get(u) or _Server(u) for u in fresh}
        # A server dropped from the list keeps its in-flight requests; only routing forgets it.
        self._servers = kept  # type: ignore[assignment]

    # -- health -----------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception as exc:  # the loop must survive a broken registry read
                log.warning("health check round failed: %s", exc)

    async def check_health(self) -> dict[str, bool]:
        """Re-read the URL list and probe `/health` on every server now; returns url -> healthy."""
        if callable(self._url_source):
            self._refresh_urls()
        servers = list(self._servers.values())
        results = await asyncio.gather(*(self._probe(s) for s in servers))
        return {s.url: ok for s, ok in zip(servers, results, strict=True)}

    async def _probe(self, server: _Server) -> bool:
        try:
            async with asyncio.timeout(max(self.health_interval_s, 2.0)):
                async with self._http().get(f"{server.url}/health") as resp:
                    ok = resp.status == 200
                    server.last_error = None if ok else f"/health answered {resp.status}"
        except (TimeoutError, *_CONNECTION_ERRORS) as exc:
            ok = False
            server.last_error = f"/health: {type(exc).__name__}: {exc}"
        if ok != server.healthy:
            log.info("server %s is now %s", server.url, "healthy" if ok else f"down ({server.last_error})")
        server.healthy = ok
        return ok

    # -- abort ------------------------------------------------------------------------------
    def _abort_later(self, url: str, rid: str) -> None:
        """Fire-and-forget `/abort_request`: runs even though the caller's task is being cancelled."""
        task = asyncio.get_running_loop().create_task(self._abort(url, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, url: str, rid: str) -> None:
        try:
            async with asyncio.timeout(_ABORT_TIMEOUT_S):
                async with self._http().post(f"{url}/abort_request", json={"rid": rid}) as resp:
                    await resp.read()
        except Exception as exc:  # best effort: the server may be the reason we gave up
            log.info("abort of %s on %s failed: %s", rid, url, exc)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient used before start(): `await client.start()` or `async with client`")
        return self._session


def adapter_version(body: dict[str, Any]) -> int | None:
    """The run version of the adapter a request body names (None: the base model, or not one of arl's names)."""
    name = body.get("lora_path")
    return lora_adapter_version(name) if isinstance(name, str) else None
