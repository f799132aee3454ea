"""`InProcessTransport`: an httpx client handing requests to an ASGI app in the same loop behaves as one over a
socket would: status, headers, body and query reach the app; responses stream chunk by chunk; a client that
closes early disconnects the request; an app that fails is a 500 (before the response) or a broken body (during).
The apps are real Starlette apps (what the proxy is built on)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pipeline.proxy.inprocess import InProcessTransport


class Gates:
    def __init__(self) -> None:
        self.second_chunk = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.sent_after_close: list[str] = []


def _app(gates: Gates) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"body": body.decode(), "query": request.url.query, "auth": request.headers.get(
            "authorization"), "client": request.client, "path": request.url.path}, status_code=201,
            headers={"x-arl": "yes"})  # fmt: skip

    async def stream(request: Request) -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            yield b"data: one\n\n"
            await gates.second_chunk.wait()
            yield b"data: two\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def endless(request: Request) -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            try:
                while True:
                    yield b"data: tick\n\n"
                    await asyncio.sleep(0.01)
            finally:
                gates.disconnected.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def broken_early(request: Request) -> JSONResponse:
        raise RuntimeError("handler bug")

    async def broken_midway(request: Request) -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            yield b"data: one\n\n"
            raise RuntimeError("stream bug")

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/v1/echo", echo, methods=["POST"]), Route("/stream", stream), Route("/endless", endless),
              Route("/broken", broken_early), Route("/midway", broken_midway)]  # fmt: skip
    return Starlette(routes=routes)


def _client(gates: Gates) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=InProcessTransport(_app(gates)), base_url="http://proxy.test:8123")


async def test_request_and_response_travel_whole() -> None:
    async with _client(Gates()) as client:
        reply = await client.post("/v1/echo?a=1&b=two", content=b'{"x": 1}', headers={"Authorization": "Bearer k"})
    assert reply.status_code == 201 and reply.headers["x-arl"] == "yes"
    assert reply.json() == {"body": '{"x": 1}', "query": "a=1&b=two", "auth": "Bearer k", "client": None,
                            "path": "/v1/echo"}  # fmt: skip


async def test_a_streamed_response_arrives_chunk_by_chunk() -> None:
    gates = Gates()
    async with _client(gates) as client, client.stream("GET", "/stream") as reply:
        chunks = reply.aiter_bytes()
        first = await asyncio.wait_for(chunks.__anext__(), 5)
        assert first == b"data: one\n\n", "the first event is readable before the app has made the second"
        gates.second_chunk.set()
        rest = b"".join([chunk async for chunk in chunks])
    assert rest == b"data: two\n\n"


async def test_closing_a_stream_early_disconnects_the_request() -> None:
    gates = Gates()
    async with _client(gates) as client:
        async with client.stream("GET", "/endless") as reply:
            async for chunk in reply.aiter_bytes():
                assert chunk.startswith(b"data: tick")
                break
        await asyncio.wait_for(gates.disconnected.wait(), 10)


async def test_an_app_error_before_the_response_is_a_500() -> None:
    async with _client(Gates()) as client:
        reply = await client.get("/broken")
    assert reply.status_code == 500 and reply.text == "Internal Server Error"


async def test_an_app_error_mid_stream_breaks_the_body() -> None:
    async with _client(Gates()) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="stream bug"):
            async with client.stream("GET", "/midway") as reply:
                async for _ in reply.aiter_bytes():
                    pass


async def test_a_caller_that_gives_up_disconnects_the_request() -> None:
    gates = Gates()

    async def slow(scope, receive, send):  # type: ignore[no-untyped-def]
        await receive()  # the body
        message = await receive()  # blocks until the client goes away
        gates.sent_after_close.append(message["type"])
        gates.disconnected.set()

    async with httpx.AsyncClient(transport=InProcessTransport(slow), base_url="http://proxy.test") as client:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.post("/x", content=json.dumps({}).encode()), 0.2)
    await asyncio.wait_for(gates.disconnected.wait(), 5)
    assert gates.sent_after_close == ["http.disconnect"]
