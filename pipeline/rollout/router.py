"""A small router in front of several proxies: one URL for agents, sessions pinned to one proxy.

A session's conversation tree lives in the proxy that started it, so every later call of the
session must reach that proxy. The router assigns each new session to the least-loaded proxy
(open sessions pinned there; a proxy holding capacity granted through the router comes first),
remembers `session_id → proxy` and `session key → session_id` from the start response, and then
routes each request by the `session_id` in its JSON body (admin/client calls) or by its key
(session calls). Responses, streams included, are passed through byte for byte as they arrive.
Unknown sessions get a 404 in the API's own error shape; the router never logs keys.

    app = ProxyRouter(["http://node1:8000", "http://node2:8000"]).app   # serve with uvicorn
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pipeline.rollout.proxy_api import root_url

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}


@dataclass
class _Pin:
    proxy: str
    started: float = field(default_factory=time.monotonic)
    ended: bool = False


class ProxyRouter:
    def __init__(self, proxies: list[str], *, pin_ttl_s: float = 4 * 3600.0, request_timeout_s: float = 900.0) -> None:
        if not proxies:
            raise ValueError("the router needs at least one proxy URL")
        self.proxies = [root_url(p) for p in proxies]
        self.pin_ttl_s = pin_ttl_s
        self.pins: dict[str, _Pin] = {}
        self.keys: dict[str, str] = {}
        self.granted = {p: 0 for p in self.proxies}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s),
                                      limits=httpx.Limits(max_connections=None))  # fmt: skip
        self.app = FastAPI(title="arl proxy router")
        self.app.add_api_route("/health", self.health, methods=["GET"])
        self.app.add_api_route("/grant_capacity", self.grant_capacity, methods=["POST"])
        self.app.add_api_route("/rl/start_session", self.start_session, methods=["POST"])
        self.app.add_api_route("/{path:path}", self.forward, methods=["GET", "POST", "DELETE"])
        self.app.router.on_shutdown.append(self.http.aclose)

    # -- load ---------------------------------------------------------------------------------
    def load(self) -> dict[str, int]:
        counts = dict.fromkeys(self.proxies, 0)
        for pin in self.pins.values():
            counts[pin.proxy] += 0 if pin.ended else 1
        return counts

    def _least_loaded(self, prefer_granted: bool) -> list[str]:
        load = self.load()
        order = sorted(self.proxies, key=lambda p: (load[p], self.proxies.index(p)))
        if prefer_granted:
            order.sort(key=lambda p: self.granted[p] <= 0)  # stable: granted proxies first, by load
        return order

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.pin_ttl_s
        for session_id in [s for s, pin in self.pins.items() if pin.started < cutoff]:
            self._unpin(session_id)

    def _unpin(self, session_id: str) -> None:
        self.pins.pop(session_id, None)
        for key in [k for k, s in self.keys.items() if s == session_id]:
            del self.keys[key]

    # -- endpoints ----------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "proxies": self.load()}

    async def grant_capacity(self, request: Request) -> Response:
        body = await request.body()
        target = self._least_loaded(prefer_granted=False)[0]
        response = await self._send(request, target, "/grant_capacity", body, stream=False)
        if response.status_code < 300:
            self.granted[target] += _int_field(body, "count", 1)
        return response

    async def start_session(self, request: Request) -> Response:
        self._expire()
        body = await request.body()
        response: Response | None = None
        for target in self._least_loaded(prefer_granted=True):
            upstream = await self._call(request, target, "/rl/start_session", body)
            response = _relay(upstream)
            if upstream.status_code == 429:
                continue  # this proxy is full or holds sessions back; another may admit
            if upstream.status_code < 300:
                data = upstream.json()
                self.pins[str(data["session_id"])] = _Pin(target)
                self.keys[str(data["api_key"])] = str(data["session_id"])
                self.granted[target] = max(self.granted[target] - 1, 0)
            return response
        assert response is not None
        return response

    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        session_id = _json_field(body, "session_id") or self.keys.get(_key_of(request) or "")
        pin = self.pins.get(session_id) if session_id else None
        if pin is None:
            if path == "v1/models" or (not session_id and _key_of(request) is None):
                return await self._send(request, self.proxies[0], f"/{path}", body, stream=False)
            return _unknown_session(path, session_id)
        response = await self._send(request, pin.proxy, f"/{path}", body, stream=True)
        if response.status_code < 300 and path in ("rl/end_session", "rl/v1/finalize"):
            pin.ended = True
        if response.status_code < 300 and path == "export_trajectories" and session_id:
            self._unpin(session_id)
        return response

    # -- plumbing -----------------------------------------------------------------------------
    async def _call(self, request: Request, target: str, path: str, body: bytes) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            return await self.http.request(request.method, target + path, content=body, headers=headers,
                                           params=request.query_params)  # fmt: skip
        except httpx.HTTPError as exc:
            return httpx.Response(502, json={"error": {"message": f"proxy {target} unreachable: {exc}",
                                                       "type": "upstream_error"}})  # fmt: skip

    async def _send(self, request: Request, target: str, path: str, body: bytes, *, stream: bool) -> Response:
        if not stream:
            return _relay(await self._call(request, target, path, body))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        upstream_request = self.http.build_request(request.method, target + path, content=body, headers=headers,
                                                   params=request.query_params)  # fmt: skip
        try:
            upstream = await self.http.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": {"message": f"proxy {target} unreachable: {exc}", "type": "upstream_error"}},
                                status_code=502)  # fmt: skip
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                 headers=_response_headers(upstream),
                                 background=BackgroundTask(upstream.aclose))  # fmt: skip


def _relay(upstream: httpx.Response) -> Response:
    return Response(upstream.content, status_code=upstream.status_code, headers=_response_headers(upstream))


def _response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}


def _key_of(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def _json_field(body: bytes, name: str) -> str | None:
    try:
        data = json.loads(body) if body else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, str) and value else None


def _int_field(body: bytes, name: str, default: int) -> int:
    try:
        value = json.loads(body).get(name, default) if body else default
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return default
    return value if isinstance(value, int) and value > 0 else default


def _unknown_session(path: str, session_id: str | None) -> JSONResponse:
    what = f"session {session_id!r}" if session_id else "this API key's session"
    message = f"unknown session: {what} was not started through this router (or was already exported)"
    if path.startswith("v1/messages"):
        body: dict[str, Any] = {"type": "error", "error": {"type": "not_found_error", "message": message}}
    else:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": "unknown_session"}}
    return JSONResponse(body, status_code=404)
