"""An httpx transport that hands requests straight to the proxy's ASGI app, in the same event loop.

Inline agents run in the rollout process beside the proxy. Over loopback TCP each of their calls is
written by the client, read and parsed by uvicorn, and the answer written and parsed back, all on the
one core that also runs the agents and the proxy: measured here with the OpenAI SDK, 3.1 ms of CPU
per call over loopback (aiohttp client, uvicorn server) against 1.6 ms handed over in process, the
difference being the sockets and two HTTP parsers. The `http_client` offered to inline agents mounts
this transport for the proxy's own URL only; every other URL (a tool's web API, say) goes out over
the network as before, and agents that build their own client reach the proxy over TCP.

The app sees what uvicorn would give it (the same routes, middleware, key checks and body limit), with
`client` set to None: there is no peer address. Responses stream: the body is handed to the client
chunk by chunk as the app sends it (server-sent events arrive as they are produced), and a client that
closes a response early disconnects the request, as a closed socket would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httpx

_END = b""


class InProcessTransport(httpx.AsyncBaseTransport):
    """Serves every request it is given with `app` (an ASGI 3 application), without a socket."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        exchange = _Exchange(await request.aread())
        exchange.run(self.app, _scope(request))
        try:
            await exchange.wake
        except asyncio.CancelledError:  # the caller gave up (a run's deadline): as if it had closed the socket
            await exchange.close()
            raise
        if exchange.status is None:
            task = exchange.task
            error = None if task.cancelled() else task.exception()
            message = b"Internal Server Error" if error is not None else b"the proxy app returned no response"
            # What uvicorn answers for an app that raised (or returned) before it began a response.
            return httpx.Response(
                500, headers={"content-type": "text/plain; charset=utf-8"}, content=message, request=request
            )
        return httpx.Response(exchange.status, headers=exchange.headers, stream=_Body(exchange), request=request)


def _scope(request: httpx.Request) -> dict[str, Any]:
    url = request.url
    port = url.port or (443 if url.scheme == "https" else 80)
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": url.scheme,
        "path": url.path,
        "raw_path": url.raw_path.split(b"?")[0],
        "query_string": url.query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "client": None,
        "server": (url.host, port),
        "state": {},
    }


class _Exchange:
    """One request between the client and the app: the request body in, the response out.

    `wake` is a future the client awaits: resolved when the app starts its response, sends body, or ends."""

    def __init__(self, body: bytes) -> None:
        self.loop = asyncio.get_running_loop()
        self.body: bytes | None = body
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.ended = False
        """The app sent its last body chunk."""
        self.disconnected: asyncio.Future[None] = self.loop.create_future()
        self.wake: asyncio.Future[None] = self.loop.create_future()
        self.task: asyncio.Task[None]

    def run(self, app: Any, scope: dict[str, Any]) -> None:
        self.task = self.loop.create_task(app(scope, self.receive, self.send))
        self.task.add_done_callback(lambda _: self._wake())

    def _wake(self) -> None:
        if not self.wake.done():
            self.wake.set_result(None)

    def rearm(self) -> None:
        if self.wake.done():
            self.wake = self.loop.create_future()

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.shield(self.disconnected)  # the app waits for a disconnect: it comes when the client closes
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.disconnected.done():
            raise OSError("the client closed the response")  # what a write to a closed socket raises
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = list(message.get("headers", []))
        elif kind == "http.response.body":
            chunk = bytes(message.get("body", b""))
            if chunk:
                self.chunks.append(chunk)
            if not message.get("more_body", False):
                self.ended = True
        self._wake()

    async def close(self) -> None:
        """The client is done (read it all, or gave up): disconnect, and let the app finish (cancel it if it
        does not within 5 s, e.g. a handler that never listens for a disconnect)."""
        if not self.disconnected.done():
            self.disconnected.set_result(None)
        task = self.task
        if not task.done():
            await asyncio.wait({task}, timeout=5.0)
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        elif not task.cancelled():
            task.exception()  # retrieved: an error after the response ended is not news for the event-loop log


class _Body(httpx.AsyncByteStream):
    """The response body as the app sends it; closing it early disconnects the request."""

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange

    async def __aiter__(self) -> AsyncIterator[bytes]:
        exchange = self.exchange
        while True:
            while exchange.chunks:
                yield exchange.chunks.popleft()
            if exchange.ended:
                return
            if exchange.task.done():
                error = None if exchange.task.cancelled() else exchange.task.exception()
                raise httpx.RemoteProtocolError(f"the proxy app stopped mid-response: {error!r}")
            exchange.rearm()
            if not (exchange.chunks or exchange.ended):
                await exchange.wake

    async def aclose(self) -> None:
        await self.exchange.close()
