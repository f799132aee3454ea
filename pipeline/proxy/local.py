"""`LocalControl`: the `ProxyControl` of the process that serves the proxy, calling its session store directly.

The rollout stage and the standalone proxy stage run the proxy in their own event loop, so they
drive its sessions without HTTP: no admin key round trip, no health polling, and an export waits for
the session's calls in flight (an awaitable on the session, with a deadline) where an HTTP export
answers 409. Refusals come back as the same `ProxyAPIError` / `NoCapacity` (with the HTTP status the
endpoint would have answered) that `HttpControl` raises, so callers handle one error type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pipeline.proxy import rl
from pipeline.proxy.capacity import Capacity
from pipeline.proxy.control import ExportedSession, NoCapacity, ProxyAPIError, SessionInfo
from pipeline.proxy.errors import ApiError
from pipeline.proxy.sessions import Session, SessionStore
from pipeline.proxy.trajectory import EXPORT_STYLES, ExportStyle
from schemas.api.rl import SamplingOverride

OWNER = "admin"
"""Sessions started in process belong to the admin, as if started with the admin key."""


@contextlib.contextmanager
def _as_proxy_errors() -> Iterator[None]:
    try:
        yield
    except ApiError as err:
        cls = NoCapacity if err.status == 429 else ProxyAPIError
        raise cls(err.message, status=err.status, body=err.message) from None


class LocalControl:
    """See the module docstring. `export_wait_s`: how long an export waits for calls still in flight."""

    def __init__(self, store: SessionStore, *, export_wait_s: float = 30.0) -> None:
        self.store = store
        self.export_wait_s = export_wait_s

    @property
    def capacity(self) -> Capacity:
        """The proxy's session counts (granted slots, open and started sessions)."""
        return self.store.capacity

    def _session(self, session_id: str) -> Session:
        return self.store.get(session_id)

    async def grant_capacity(self, count: int = 1) -> None:
        self.store.grant(count)

    async def start_session(
        self,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling: SamplingOverride | None = None,
    ) -> SessionInfo:
        with _as_proxy_errors():
            session = self.store.start(OWNER, group_id, metadata or {}, sampling)
        return SessionInfo(session.id, session.api_key)

    async def set_reward(self, session_id: str, reward: float, interaction_id: str | None = None) -> None:
        with _as_proxy_errors():
            rl.reward(self._session(session_id), reward, interaction_id)

    async def end_session(self, session_id: str, status: str | None = None) -> None:
        with _as_proxy_errors():
            await self.store.end(self._session(session_id), "end_session", status or "ok")

    async def export(self, session_id: str, *, style: str, discount: float) -> ExportedSession:
        """Waits up to `export_wait_s` for calls in flight (a cancelled agent's request finishing or being
        aborted), then exports; 409 naming the session if they are still running."""
        if style not in EXPORT_STYLES:
            raise ProxyAPIError(f"export style must be one of {list(EXPORT_STYLES)}, got {style!r}", status=400)
        export_style: ExportStyle = "concat" if style == "concat" else "individual"
        with _as_proxy_errors():
            session = self._session(session_id)
            await session.wait_idle(self.export_wait_s)
            return self.store.export(session, export_style, discount)
