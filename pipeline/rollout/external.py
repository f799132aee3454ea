"""Steps from external agents: the standalone proxy stage turns finished outside sessions into shards.

Outside agents (`pipeline.client.AgentSession`, or any client with a client key) start sessions
themselves, so the stage learns about them by watching its own proxy's HTTP traffic
(`SessionObserver`, an ASGI middleware added before the proxy starts): a successful
`/rl/start_session` response gives the session id and key, a successful `/rl/end_session` or
`/rl/v1/finalize` marks the session finished (with `x-arl-run-status: failed|rejected`, sent by
`AgentSession` on an exception or a reject, its samples are dropped), and every session-key
request refreshes the session's last activity. A session idle past `proxy.session_timeout_s`
(which the proxy ends itself) is exported and counted as abandoned, not trained on.

Finished sessions are exported (admin key, over HTTP) as they finish and fill the current step in
finish order; `batch_size` sessions with samples make a step, published like the rollout's
(stale samples dropped, constant groups dropped if configured, metrics line, cursor-free: the
step number is the first one without a manifest). Admission follows the same staleness rule as
the rollout: capacity is granted through `/grant_capacity` only for steps whose bound
k - max_staleness the published weight version meets (this needs `proxy.require_capacity: true`;
without it sessions are admitted freely and only the per-token check applies).

Nothing finished is lost to a kill: the end call of a session is held until the stage has exported
the session and written it to the spool (`pipeline.rollout.spool`, `state/proxy_spool/`), so a 2xx
means the session is on disk. A restarted stage loads the spool and counts those sessions toward the
next step; a step's manifest lists the sessions it consumed (`extra.consumed_sessions`), their spool
files are removed after it is published, and on restart spooled sessions a published step already
holds are dropped, so none is counted twice. If export or spooling fails the end call answers 503
naming the session and the stage stops with the error.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import ArlError
from pipeline.paths import RunPaths
from pipeline.rollout.metrics import StepTally
from pipeline.rollout.proxy_api import RUN_STATUS_HEADER, ProxyAPI
from pipeline.rollout.spool import CONSUMED_KEY, Spool, SpooledSession
from pipeline.stage import StageContext
from pipeline.weight_version import published_version
from schemas.config import ArlConfig

log = logging.getLogger("arl.proxy.external")

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
                   Awaitable[None]]  # fmt: skip
Recorder = Callable[[str, str], Awaitable[SpooledSession]]
END_PATHS = ("/rl/end_session", "/rl/v1/finalize")


@dataclass
class Tracked:
    session_id: str
    started: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)


class SessionLedger:
    """What the observer saw: open sessions by id and by key, and a queue of finished, spooled ones."""

    def __init__(self) -> None:
        self.sessions: dict[str, Tracked] = {}
        self.by_key: dict[str, str] = {}
        self.finished: asyncio.Queue[SpooledSession] = asyncio.Queue()
        self.started_total = 0
        self.recording = 0
        """Sessions being exported and spooled right now (still occupying capacity)."""
        self.saving: dict[str, asyncio.Future[BaseException | None]] = {}
        """Per session being saved: its outcome, so a repeated end call answers only once it is on disk."""
        self.recorder: Recorder | None = None
        self.ready = asyncio.Event()
        """Set once `recorder` exists: an end call arriving while the stage starts waits for it."""
        self.error: BaseException | None = None

    def started(self, session_id: str, key: str) -> None:
        self.sessions[session_id] = Tracked(session_id)
        self.by_key[key] = session_id
        self.started_total += 1

    def seen(self, key: str | None) -> None:
        session_id = self.by_key.get(key or "")
        if session_id in self.sessions:
            self.sessions[session_id].last_seen = time.monotonic()

    def idle(self, idle_s: float) -> list[str]:
        now = time.monotonic()
        return [t.session_id for t in self.sessions.values() if now - t.last_seen > idle_s]

    async def finish(self, session_id: str | None, status: str) -> None:
        """Export and spool a finished session, then queue it. Raises if either fails (the caller's end
        call then answers 503) and remembers the error for `check` (the stage then stops)."""
        if session_id is not None and session_id in self.saving:  # a second end call for the same session
            outcome = await asyncio.shield(self.saving[session_id])
            if outcome is not None:
                raise outcome
            return
        if session_id is None or session_id not in self.sessions:
            return
        del self.sessions[session_id]
        for key in [k for k, s in self.by_key.items() if s == session_id]:
            del self.by_key[key]
        self.recording += 1
        saved: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self.saving[session_id] = saved
        try:
            await self.ready.wait()
            assert self.recorder is not None
            record = await self.recorder(session_id, status)
            self.finished.put_nowait(record)
            saved.set_result(None)
        except Exception as exc:
            self.error = self.error or exc
            saved.set_result(exc)
            raise
        finally:
            self.recording -= 1
            del self.saving[session_id]
            if not saved.done():  # cancelled mid-save: a waiting twin must not answer 2xx
                saved.set_result(ArlError(f"saving session {session_id} was cancelled"))

    def check(self) -> None:
        if self.error is not None:
            raise ArlError(f"a finished outside session could not be exported and spooled ({self.error}); its end "
                           "call answered 503. Fix the cause (disk full? proxy error in this log?) and restart the "
                           "stage: every session it had spooled is kept.") from self.error  # fmt: skip


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
        if path == "/rl/start_session":
            return await self._start(scope, receive, send)
        if path not in END_PATHS:
            return await self.app(scope, receive, send)
        body, replay = await _buffer(receive)
        held: list[dict[str, Any]] = []

        async def hold(message: dict[str, Any]) -> None:
            held.append(message)

        await self.app(scope, replay, hold)
        status = next((int(m["status"]) for m in held if m["type"] == "http.response.start"), 500)
        if status < 300:
            session_id = _json(body).get("session_id") or self.ledger.by_key.get(key or "")
            run_status = headers.get(RUN_STATUS_HEADER, "ok")
            try:  # the answer waits until the session is on disk: a 2xx promises it is not lost
                await self.ledger.finish(session_id, run_status if run_status in ("failed", "rejected") else "ok")
            except Exception as exc:
                log.exception("session %s ended but could not be exported and spooled", session_id)
                held = _error_response(503, f"session {session_id} ended, but the proxy stage could not save it "
                                       f"({type(exc).__name__}: {exc}); it will not be trained on")  # fmt: skip
        for message in held:
            await send(message)

    async def _start(self, scope: Scope, receive: Any, send: Any) -> None:
        status: list[int] = []
        chunks: list[bytes] = []

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, capture)
        if status and status[0] < 300:
            data = _json(b"".join(chunks))
            if "session_id" in data and "api_key" in data:
                self.ledger.started(str(data["session_id"]), str(data["api_key"]))


def _error_response(status: int, message: str) -> list[dict[str, Any]]:
    from pipeline.proxy.errors import ApiError

    body = json.dumps(ApiError(status, message).openai_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return [{"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False}]  # fmt: skip


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
    count = admission.slots(step=step, version=published_version(paths),
                            max_staleness=config.rollout.max_staleness, num_steps=config.num_steps,
                            batch_size=config.rollout.batch_size, buffered=buffered,
                            in_flight=len(ledger.sessions) + ledger.recording,
                            started_total=ledger.started_total)  # fmt: skip
    if count > 0:
        await admin.grant_capacity(count)
        admission.granted += count


async def record_session(admin: ProxyAPI, spool: Spool, config: ArlConfig, session_id: str,
                         status: str) -> SpooledSession:  # fmt: skip
    """Export one finished session and write it to the spool; durable when this returns."""
    from pipeline.rollout.loop import export_session

    cfg = config.rollout
    exported = await export_session(admin, session_id, cfg.export_style, cfg.discount)
    if exported is None:  # the proxy refused (logged by export_session): recorded so the tally survives
        record = SpooledSession(session_id, "unexported", time.time())
    else:
        record = SpooledSession(session_id, status, time.time(), num_interactions=int(exported["num_interactions"]),
                                prefix_breaks=int(exported["prefix_breaks"]),
                                samples=tuple(exported["samples"]))  # fmt: skip
    await asyncio.to_thread(spool.write, record)  # fsyncs: off the event loop, other sessions keep going
    return record


def count_session(record: SpooledSession, step: int, tally: StepTally) -> list[dict[str, Any]]:
    """Tally one finished session; its rows for the step (none unless it ended well)."""
    if record.status == "unexported":
        tally.add_error(f"external session {record.session_id} could not be exported", timed_out=False)
        return []
    if record.status in ("failed", "abandoned"):
        tally.add_error(f"external session {record.session_id} {record.status}", timed_out=False)
        return []
    rows = [{**row, "step": step} for row in record.samples]
    tally.add_finished(rejected=record.status == "rejected", num_interactions=record.num_interactions,
                       prefix_breaks=record.prefix_breaks, samples=len(rows))  # fmt: skip
    return [] if record.status == "rejected" else rows


@dataclass
class ExternalRun:
    """What the stage's step loop works with."""

    admin: ProxyAPI
    ledger: SessionLedger
    spool: Spool
    paths: RunPaths
    config: ArlConfig
    sink: Any
    name: str
    admission: Admission = field(default_factory=Admission)


async def run_external(ctx: StageContext, *, name: str = "external") -> list[int]:
    """The `proxy` stage: serve the standalone proxy and publish steps of outside sessions until
    `num_steps` (or exactly `ctx.only_step`); return the steps published."""
    from pipeline.rollout.loop import missing_steps, open_sink
    from pipeline.rollout.services import open_services

    config, paths, only_step = ctx.config, ctx.paths, ctx.only_step

    if not config.proxy.require_capacity:
        log.warning("proxy.require_capacity is false: outside sessions are admitted regardless of the weight "
                    "version; only the per-token staleness check applies")  # fmt: skip
    steps = [only_step] if only_step is not None else missing_steps(paths, config.num_steps)
    ledger = SessionLedger()
    spool = Spool(paths)
    for record in spool.load():  # before serving: no write of ours is under way while its leftovers are swept
        ledger.finished.put_nowait(record)
    if ledger.finished.qsize() and steps:
        log.info("%d finished sessions from %s count toward step %d", ledger.finished.qsize(), spool.dir, steps[0])

    def observe(app: Any) -> None:
        app.add_middleware(SessionObserver, ledger=ledger)

    sink = open_sink(paths)
    async with open_services(config, paths, name=name, app_hook=observe) as services:
        try:
            ledger.recorder = functools.partial(record_session, services.admin, spool, config)
            ledger.ready.set()
            run = ExternalRun(services.admin, ledger, spool, paths, config, sink, name)
            for step in steps:
                await external_step(run, step)
        finally:
            sink.close()
    if spool.pending():
        log.info("%d finished sessions stay in %s for a later run of this stage", spool.pending(), spool.dir)
    return steps


async def external_step(run: ExternalRun, step: int) -> None:
    """Fill one step with `batch_size` finished sessions, publish it like the rollout does, then unspool them."""
    tally = StepTally(step, weight_version=published_version(run.paths))
    rows, consumed, sessions = await fill_step(run, step, tally)
    stats = publish_external_step(run.paths, run.config, step, rows, consumed, tally, run.name)
    run.spool.remove(consumed)  # only now: a crash before this is undone on restart via the manifest
    run.sink.log(step, stats)
    log.info("step %d published from %d outside sessions: %d samples, reward mean %s, %d failed/abandoned",
             step, sessions, stats["samples"], stats["reward_mean"], tally.agent_errors)  # fmt: skip


async def fill_step(run: ExternalRun, step: int, tally: StepTally) -> tuple[list[dict[str, Any]], list[str], int]:
    """Rows of the next finished sessions until `batch_size` of them had samples; every session id consumed."""
    ledger, config = run.ledger, run.config
    rows: list[dict[str, Any]] = []
    consumed: list[str] = []
    sessions = 0
    while sessions < config.rollout.batch_size:
        ledger.check()
        await admit(run.admin, run.admission, ledger, run.paths, config, step, sessions + ledger.finished.qsize())
        for session_id in ledger.idle(config.proxy.session_timeout_s + 5.0):
            await ledger.finish(session_id, "abandoned")
        try:
            record = await asyncio.wait_for(ledger.finished.get(), 0.5)
        except TimeoutError:
            continue
        consumed.append(record.session_id)
        new = count_session(record, step, tally)
        if new:
            rows.extend(new)
            sessions += 1
    return rows, consumed, sessions


def publish_external_step(paths: RunPaths, config: ArlConfig, step: int, rows: list[dict[str, Any]],
                          consumed: list[str], tally: StepTally, name: str) -> dict[str, Any]:  # fmt: skip
    """Filter and publish the step; its manifest lists `consumed` (what a restart must not count again)."""
    from pipeline.rollout.loop import filter_rows
    from pipeline.shards import write_step

    rows = filter_rows(rows, step, config, tally)
    stats = tally.summary(rows)
    rows.sort(key=lambda r: (r["group_id"], r["session_id"], r["sample_id"]))
    write_step(paths, step, rows, producer=f"proxy-{name}", tokenizer=config.model.tokenizer or config.model.path,
               extra={**stats, CONSUMED_KEY: consumed})  # fmt: skip
    return stats
