"""Steps from external agents: the standalone proxy stage turns finished outside sessions into shards.

Outside agents (`pipeline.client.AgentSession`, or any client with a client key) start sessions
themselves, so the stage learns about them by watching its own proxy's HTTP traffic
(`SessionObserver`, an ASGI middleware added before the proxy starts): a successful
`/rl/start_session` response gives the session id and key, a successful `/rl/end_session` or
`/rl/v1/finalize` marks the session finished (with `x-arl-run-status: failed|rejected`, sent by
`AgentSession` on an exception or a reject, its samples are dropped), and every session-key
request refreshes the session's last activity. A session idle past `proxy.session_timeout_s`
(which the proxy ends itself) is exported and counted as abandoned, not trained on.

Finished sessions are exported (admin key, over HTTP) in the order they finish and fill the
current step; `batch_size` sessions with samples make a step, published like the rollout's
(stale samples dropped, constant groups dropped if configured, metrics line, cursor-free: the
step number is the first one without a manifest). Admission follows the same staleness rule as
the rollout: capacity is granted through `/grant_capacity` only for steps whose bound
k - max_staleness the published weight version meets (this needs `proxy.require_capacity: true`;
without it sessions are admitted freely and only the per-token check applies).

Sessions exported but not yet published live in memory: a killed stage loses them (their agents
already have their answers; the step is simply filled by later sessions).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.paths import RunPaths
from pipeline.rollout.metrics import StepTally
from pipeline.rollout.proxy_api import RUN_STATUS_HEADER, ProxyAPI
from pipeline.rollout.staleness import published_version
from schemas.config import ArlConfig

log = logging.getLogger("arl.proxy.external")

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
                   Awaitable[None]]  # fmt: skip


@dataclass
class Tracked:
    session_id: str
    started: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Finished:
    session_id: str
    status: str
    """"ok", "failed", "rejected" or "abandoned"."""


class SessionLedger:
    """What the observer saw: sessions by id and by key, and a queue of finished ones."""

    def __init__(self) -> None:
        self.sessions: dict[str, Tracked] = {}
        self.by_key: dict[str, str] = {}
        self.finished: asyncio.Queue[Finished] = asyncio.Queue()
        self.started_total = 0

    def started(self, session_id: str, key: str) -> None:
        self.sessions[session_id] = Tracked(session_id)
        self.by_key[key] = session_id
        self.started_total += 1

    def seen(self, key: str | None) -> None:
        session_id = self.by_key.get(key or "")
        if session_id in self.sessions:
            self.sessions[session_id].last_seen = time.monotonic()

    def ended(self, session_id: str | None, status: str) -> None:
        if session_id is None or session_id not in self.sessions:
            return
        del self.sessions[session_id]
        for key in [k for k, s in self.by_key.items() if s == session_id]:
            del self.by_key[key]
        self.finished.put_nowait(Finished(session_id, status))

    def sweep_idle(self, idle_s: float) -> None:
        now = time.monotonic()
        for tracked in [t for t in self.sessions.values() if now - t.last_seen > idle_s]:
            self.ended(tracked.session_id, "abandoned")


class SessionObserver:
    """ASGI middleware feeding a `SessionLedger` from the proxy's own requests and responses."""

    def __init__(self, app: ASGIApp, ledger: SessionLedger) -> None:
        self.app = app
        self.ledger = ledger

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope.get("headers", [])}
        key = _key(headers)
        path = scope["path"]
        self.ledger.seen(key)
        if path not in ("/rl/start_session", "/rl/end_session", "/rl/v1/finalize"):
            return await self.app(scope, receive, send)
        body, replay = await _buffer(receive)
        status: list[int] = []
        chunks: list[bytes] = []

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            elif message["type"] == "http.response.body" and path == "/rl/start_session":
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, replay, capture)
        if not status or status[0] >= 300:
            return
        if path == "/rl/start_session":
            data = _json(b"".join(chunks))
            if "session_id" in data and "api_key" in data:
                self.ledger.started(str(data["session_id"]), str(data["api_key"]))
            return
        session_id = _json(body).get("session_id") or self.ledger.by_key.get(key or "")
        run_status = headers.get(RUN_STATUS_HEADER, "ok")
        self.ledger.ended(session_id, run_status if run_status in ("failed", "rejected") else "ok")


async def _buffer(receive: Any) -> tuple[bytes, Any]:
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(parts)
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def _key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key")


def _json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class Admission:
    """Capacity bookkeeping: grant slots only for steps the weight version allows."""

    granted: int = 0

    def slots(self, *, step: int, version: int, max_staleness: int, num_steps: int, batch_size: int,
              buffered: int, in_flight: int, started_total: int) -> int:  # fmt: skip
        last_allowed = min(version + max_staleness, num_steps - 1)
        if last_allowed < step:
            return 0
        allowed = (last_allowed - step + 1) * batch_size - buffered
        outstanding = max(self.granted - started_total, 0)
        return max(allowed - in_flight - outstanding, 0)


async def admit(admin: ProxyAPI, admission: Admission, ledger: SessionLedger, paths: RunPaths, config: ArlConfig,
                step: int, buffered: int) -> None:  # fmt: skip
    """Top the proxy's capacity up to what the staleness bound allows right now."""
    count = admission.slots(step=step, version=published_version(paths.weight_version),
                            max_staleness=config.rollout.max_staleness, num_steps=config.num_steps,
                            batch_size=config.rollout.batch_size, buffered=buffered,
                            in_flight=len(ledger.sessions), started_total=ledger.started_total)  # fmt: skip
    if count > 0:
        await admin.grant_capacity(count)
        admission.granted += count


async def collect_one(admin: ProxyAPI, finished: Finished, config: ArlConfig, step: int,
                      tally: StepTally) -> list[dict[str, Any]]:  # fmt: skip
    """Export one finished session; its rows for the current step (none unless it ended well)."""
    from pipeline.rollout.loop import export_session

    cfg = config.rollout
    exported = await export_session(admin, finished.session_id, cfg.export_style, cfg.discount)
    if exported is None:
        tally.add_error(f"external session {finished.session_id} could not be exported", timed_out=False)
        return []
    rows = [{**row, "step": step} for row in exported["samples"]]
    if finished.status in ("failed", "abandoned"):
        tally.add_error(f"external session {finished.session_id} {finished.status}", timed_out=False)
        return []
    tally.add_finished(rejected=finished.status == "rejected", num_interactions=int(exported["num_interactions"]),
                       prefix_breaks=int(exported["prefix_breaks"]), samples=len(rows))  # fmt: skip
    return [] if finished.status == "rejected" else rows


async def run_external(config: ArlConfig, paths: RunPaths, *, name: str = "external",
                       only_step: int | None = None) -> list[int]:  # fmt: skip
    """Serve the standalone proxy and publish steps of outside sessions until `num_steps` (or `only_step`)."""
    from pipeline.rollout.loop import missing_steps, open_sink
    from pipeline.rollout.services import open_services

    if not config.proxy.require_capacity:
        log.warning("proxy.require_capacity is false: outside sessions are admitted regardless of the weight "
                    "version; only the per-token staleness check applies")  # fmt: skip
    steps = [only_step] if only_step is not None else missing_steps(paths, config.num_steps)
    ledger = SessionLedger()

    def observe(app: Any) -> None:
        app.add_middleware(SessionObserver, ledger=ledger)

    sink = open_sink(paths)
    async with open_services(config, paths, name=name, app_hook=observe) as services:
        try:
            admission = Admission()
            for step in steps:
                await external_step(services.admin, admission, ledger, paths, config, step, sink, name)
        finally:
            sink.close()
    return steps


async def external_step(admin: ProxyAPI, admission: Admission, ledger: SessionLedger, paths: RunPaths,
                        config: ArlConfig, step: int, sink: Any, name: str) -> None:  # fmt: skip
    """Fill one step with `batch_size` finished sessions, then publish it like the rollout does."""
    from pipeline.rollout.loop import filter_rows
    from pipeline.shards import write_step

    tally = StepTally(step, weight_version=published_version(paths.weight_version))
    rows: list[dict[str, Any]] = []
    sessions = 0
    while sessions < config.rollout.batch_size:
        await admit(admin, admission, ledger, paths, config, step, sessions + ledger.finished.qsize())
        ledger.sweep_idle(config.proxy.session_timeout_s + 5.0)
        try:
            finished = await asyncio.wait_for(ledger.finished.get(), 0.5)
        except TimeoutError:
            continue
        new = await collect_one(admin, finished, config, step, tally)
        if new:
            rows.extend(new)
            sessions += 1
    rows = filter_rows(rows, step, config, tally)
    stats = tally.summary(rows)
    rows.sort(key=lambda r: (r["group_id"], r["session_id"], r["sample_id"]))
    write_step(paths, step, rows, producer=f"proxy-{name}", tokenizer=config.model.tokenizer or config.model.path,
               extra=stats)  # fmt: skip
    sink.log(step, stats)
    log.info("step %d published from %d outside sessions: %d samples, reward mean %s, %d failed/abandoned",
             step, sessions, len(rows), stats["reward_mean"], tally.agent_errors)  # fmt: skip
