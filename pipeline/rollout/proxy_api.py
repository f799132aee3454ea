"""The proxy's HTTP API (SPEC §4) as the rollout, the standalone proxy stage and `pipeline.client` use it.

Everything goes over HTTP, even when the proxy runs in the same process: the same code then drives
an in-process proxy, a standalone one on another node, or the router in front of several.
Only `httpx` is imported here, so `pipeline.client` stays light enough for any agent machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from pipeline.errors import ArlError

RUN_STATUS_HEADER = "x-arl-run-status"


class ProxyAPIError(ArlError):
    """The proxy answered with an error status (or could not be reached)."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class NoCapacity(ProxyAPIError):
    """`/rl/start_session` answered 429: the capacity gate (or `max_sessions`) holds new sessions back."""


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    api_key: str


def root_url(url: str) -> str:
    """`http://h:p` from `http://h:p/`, `http://h:p/v1` or `http://h:p/v1/`: endpoints are joined to the root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _post(http: httpx.AsyncClient, url: str, key: str, body: dict[str, Any] | None,
                extra_headers: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    try:
        headers = {**_auth(key), **(extra_headers or {})}
        response = await http.post(url, json=body if body is not None else {}, headers=headers)
    except httpx.HTTPError as exc:
        raise ProxyAPIError(f"POST {url} failed: {type(exc).__name__}: {exc}. Is the proxy running?") from exc
    if response.status_code >= 400:
        text = response.text[:2000]
        cls = NoCapacity if response.status_code == 429 else ProxyAPIError
        raise cls(f"POST {url} answered {response.status_code}: {text}", status=response.status_code, body=text)
    if not response.content:
        return {}
    data = response.json()
    return data if isinstance(data, dict) else {"result": data}


class ProxyAPI:
    """Calls with one key (admin or client) against one proxy root URL."""

    def __init__(self, url: str, key: str, http: httpx.AsyncClient) -> None:
        self.url = root_url(url)
        self.key = key
        self.http = http

    async def grant_capacity(self, count: int = 1) -> None:
        """Admit `count` more sessions through the proxy's capacity gate (admin key)."""
        await _post(self.http, f"{self.url}/grant_capacity", self.key, {"count": count})

    async def start_session(self, group_id: str | None = None, metadata: dict[str, Any] | None = None) -> SessionInfo:
        body: dict[str, Any] = {"metadata": metadata or {}}
        if group_id is not None:
            body["group_id"] = group_id
        data = await _post(self.http, f"{self.url}/rl/start_session", self.key, body)
        try:
            return SessionInfo(session_id=str(data["session_id"]), api_key=str(data["api_key"]))
        except KeyError as exc:
            raise ProxyAPIError(f"{self.url}/rl/start_session answered without {exc}: {data}") from None

    async def export(self, session_id: str, *, style: str, discount: float) -> dict[str, Any]:
        """`/export_trajectories` (admin key): the session's samples; the proxy forgets the session."""
        body = {"session_id": session_id, "style": style, "discount": discount}
        data = await _post(self.http, f"{self.url}/export_trajectories", self.key, body)
        if not isinstance(data.get("samples"), list):
            raise ProxyAPIError(f"{self.url}/export_trajectories answered without a samples list: {str(data)[:500]}")
        return data

    async def health(self) -> bool:
        try:
            response = await self.http.get(f"{self.url}/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200


class SessionAPI:
    """Calls with one session's key: rewards and the end of the session."""

    def __init__(self, url: str, session: SessionInfo, http: httpx.AsyncClient) -> None:
        self.url = root_url(url)
        self.session = session
        self.http = http

    async def set_reward(self, reward: float, interaction_id: str | None = None) -> None:
        body: dict[str, Any] = {"reward": float(reward)}
        if interaction_id is not None:
            body["interaction_id"] = interaction_id
        await _post(self.http, f"{self.url}/rl/set_reward", self.session.api_key, body)

    async def end(self, status: str | None = None) -> None:
        """End the session. `status` ("failed", "rejected") travels as the `x-arl-run-status` header: the
        standalone proxy stage then drops the session's samples; any other proxy ignores the header."""
        extra = {RUN_STATUS_HEADER: status} if status is not None else None
        await _post(self.http, f"{self.url}/rl/end_session", self.session.api_key, {}, extra)
