"""Driving the proxy's sessions: the `ProxyControl` interface and its HTTP implementation.

Whoever runs agents drives a session the same way: grant capacity, start the session, let the agent
call the LLM routes with the session key, set rewards, end it, export its rows. Two implementations:

* `pipeline.proxy.local.LocalControl`: in the process that serves the proxy (the rollout stage, the
  standalone proxy stage). It calls the session store directly: no HTTP, no admin key, and an export
  waits for the session's calls in flight instead of answering 409.
* `HttpControl`: the same five calls over the proxy's HTTP endpoints (docs/proxy.md) with an admin or
  client key, for agents on other machines (`pipeline.client`) and operators.

`SessionClient` is what an agent holds: one session's key, for rewards and the end call.

Only `httpx` is imported here (the row type is imported when an export is parsed), so
`pipeline.client` stays light enough for any agent machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from pipeline.errors import ArlError
from schemas.api.rl import SamplingOverride

if TYPE_CHECKING:
    from schemas.trajectory import TrajectoryRow

RUN_STATUS_HEADER = "x-arl-run-status"
"""Sent with an end call: `failed` or `rejected` tell the standalone proxy stage to train on none of the
session's samples (any other value, or none, means the run ended well)."""
RUN_STATUSES = ("ok", "failed", "rejected")


class ProxyAPIError(ArlError):
    """The proxy refused a call (`status` is the HTTP status it answered) or could not be reached (None)."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body

    @property
    def refused(self) -> bool:
        """The proxy answered and said no (4xx): the call's input was wrong, not the proxy or the link."""
        return self.status is not None and self.status < 500


class NoCapacity(ProxyAPIError):
    """Starting a session answered 429: the capacity gate (or `proxy.max_sessions`) holds new sessions back."""


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    api_key: str
    url: str | None = None
    """The root URL of the proxy process serving the session, when it differs by session (a pool of workers:
    `pipeline.proxy.pool`); None: the proxy's one URL."""


@dataclass(frozen=True)
class ExportedSession:
    """A session's training rows, as an export hands them over (the proxy has forgotten the session)."""

    session_id: str
    group_id: str
    rows: list[TrajectoryRow]
    """No step assigned yet (`TrajectoryRow.step` is None)."""
    num_interactions: int
    prefix_breaks: int
    first_call_s: float | None = None
    """Seconds from the session's start to its first LLM call (the agent's start-up); None: no call."""
    last_refusal: str | None = None
    """The last error the proxy answered one of the session's calls with (`status: message`); None: none."""

    def to_json(self) -> dict[str, Any]:
        """The `/export_trajectories` answer (rows in their wire form: every column but `step`)."""
        return {
            "session_id": self.session_id,
            "group_id": self.group_id,
            "samples": [row.to_wire() for row in self.rows],
            "num_interactions": self.num_interactions,
            "prefix_breaks": self.prefix_breaks,
            "first_call_s": self.first_call_s,
            "last_refusal": self.last_refusal,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExportedSession:
        from schemas.trajectory import TrajectoryRow

        return cls(
            str(data["session_id"]),
            str(data["group_id"]),
            [TrajectoryRow.from_wire(sample) for sample in data["samples"]],
            int(data["num_interactions"]),
            int(data["prefix_breaks"]),
            _optional_float(data.get("first_call_s")),
            None if data.get("last_refusal") is None else str(data["last_refusal"]),
        )


class ProxyControl(Protocol):
    """Session control with an admin's rights (a client key: its own sessions, no capacity, no export)."""

    async def grant_capacity(self, count: int = 1) -> None:
        """Admit `count` more sessions through the capacity gate (`proxy.require_capacity`)."""
        ...

    async def start_session(
        self,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling: SamplingOverride | None = None,
    ) -> SessionInfo:
        """A new session (its calls sampled as `sampling` imposes, if given); `NoCapacity` while the gate or
        `proxy.max_sessions` holds it back."""
        ...

    async def set_reward(self, session_id: str, reward: float, interaction_id: str | None = None) -> None:
        """Reward the session's last completion, or the completion/response/message `interaction_id`."""
        ...

    async def end_session(self, session_id: str, status: str | None = None) -> None:
        """No more LLM calls; returns once every subscriber to the session's end has handled it."""
        ...

    async def export(self, session_id: str, *, style: str, discount: float) -> ExportedSession:
        """The session's rows (rewards propagated with `discount`); the proxy then forgets the session."""
        ...


def root_url(url: str) -> str:
    """`http://h:p` from `http://h:p/`, `http://h:p/v1` or `http://h:p/v1/`: endpoints are joined to the root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def _post(
    http: httpx.AsyncClient, url: str, key: str, body: dict[str, Any], extra_headers: dict[str, str] | None = None
) -> dict[str, Any]:
    try:
        headers = {"Authorization": f"Bearer {key}", **(extra_headers or {})}
        response = await http.post(url, json=body, headers=headers)
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


def _status_header(status: str | None) -> dict[str, str] | None:
    return {RUN_STATUS_HEADER: status} if status is not None else None


class HttpControl:
    """`ProxyControl` over HTTP with one key (admin or client) against one proxy root URL. `export_wait_s`: how
    long an export lets the proxy wait for the session's calls in flight (0: a 409 at once)."""

    def __init__(self, url: str, key: str, http: httpx.AsyncClient, *, export_wait_s: float = 0.0) -> None:
        self.url = root_url(url)
        self.key = key
        self.http = http
        self.export_wait_s = export_wait_s

    async def grant_capacity(self, count: int = 1) -> None:
        await _post(self.http, f"{self.url}/grant_capacity", self.key, {"count": count})

    async def start_session(
        self,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling: SamplingOverride | None = None,
    ) -> SessionInfo:
        body: dict[str, Any] = {"metadata": metadata or {}}
        if group_id is not None:
            body["group_id"] = group_id
        if sampling is not None:
            body["sampling"] = sampling.model_dump(exclude_none=True)
        data = await _post(self.http, f"{self.url}/rl/start_session", self.key, body)
        try:
            return SessionInfo(session_id=str(data["session_id"]), api_key=str(data["api_key"]))
        except KeyError as exc:
            raise ProxyAPIError(f"{self.url}/rl/start_session answered without {exc}: {data}") from None

    async def set_reward(self, session_id: str, reward: float, interaction_id: str | None = None) -> None:
        body: dict[str, Any] = {"session_id": session_id, "reward": float(reward)}
        if interaction_id is not None:
            body["interaction_id"] = interaction_id
        await _post(self.http, f"{self.url}/rl/set_reward", self.key, body)

    async def end_session(self, session_id: str, status: str | None = None) -> None:
        await _post(
            self.http, f"{self.url}/rl/end_session", self.key, {"session_id": session_id}, _status_header(status)
        )

    async def export(self, session_id: str, *, style: str, discount: float) -> ExportedSession:
        """`/export_trajectories` (admin key); a session with calls in flight after `export_wait_s` answers 409
        (`ProxyAPIError`)."""
        body: dict[str, Any] = {"session_id": session_id, "style": style, "discount": discount}
        if self.export_wait_s:
            body["wait_s"] = self.export_wait_s
        data = await _post(self.http, f"{self.url}/export_trajectories", self.key, body)
        try:
            return ExportedSession.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProxyAPIError(
                f"{self.url}/export_trajectories answered an unexpected body ({exc!r}): {str(data)[:500]}"
            ) from None


class SessionClient:
    """One session's calls with its own key: rewards and the end of the session."""

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
        """End the session; `status` ("failed", "rejected") travels as the `x-arl-run-status` header."""
        await _post(self.http, f"{self.url}/rl/end_session", self.session.api_key, {}, _status_header(status))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
