"""Steps from external agents: the standalone proxy stage turns finished outside sessions into shards.

Outside agents (`pipeline.client.AgentSession`, or any client with a client key) start and end
sessions themselves. The stage learns that one finished from the proxy's session store, which
announces every end (`/rl/end_session`, `/rl/v1/finalize`, or `proxy.session_timeout_s` of
idleness) to its subscribers: `SpoolSubscriber` is one. It exports the session in process, writes
it to the spool (`pipeline.rollout.spool`, `state/proxy_spool/`) and queues it for the step being
filled. The end call's `x-arl-run-status: failed|rejected` header (sent by `AgentSession` on an
exception or a reject) reaches it through the store and drops the session's samples; a session the
proxy ended for idleness is counted as abandoned, not trained on.

Finished sessions fill the current step in finish order; `batch_size` sessions with samples make a
step, published like the rollout's (stale samples dropped, constant groups dropped if configured,
metrics line, cursor-free: the step number is the first one without a manifest). Admission follows
the same staleness rule as the rollout: capacity is granted only for steps whose bound
max(k - max_staleness, 0) the published weight version meets, i.e. steps up to
`newest_servable_step(version, max_staleness)` (this needs `proxy.require_capacity: true`;
without it sessions are admitted freely and only the per-token check applies).

Nothing finished is lost to a kill: the end call answers only once the subscriber has exported the
session and written it to the spool, so a 2xx means the session is on disk (a repeated end call
waits for the same save). A restarted stage loads the spool and counts those sessions toward the
next step; a step's manifest lists the sessions it consumed (`extra.consumed_sessions`), their spool
files are removed after it is published, and on restart spooled sessions a published step already
holds are dropped, so none is counted twice. If export or spooling fails the end call answers 503
naming the session and the stage stops with the error. docs/rollout.md, "External agents".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.agents.episode import export_session, sort_key
from pipeline.errors import ArlError
from pipeline.proxy.control import ProxyControl
from pipeline.proxy.local import LocalControl
from pipeline.proxy.pool import PoolControl
from pipeline.proxy.sessions import EndHook, SessionEnd
from pipeline.rollout.loop import filter_rows, missing_steps, open_sink
from pipeline.rollout.spool import CONSUMED_KEY, Spool, SpooledSession
from pipeline.rollout.stats import StepTally
from pipeline.run.paths import RunPaths
from pipeline.run.stage import StageContext
from pipeline.run.weight_version import newest_servable_step, published_version
from schemas.config import ArlConfig
from schemas.trajectory import TrajectoryRow

log = logging.getLogger("arl.proxy.external")


class SpoolSubscriber:
    """Subscribed to the proxy's session ends: each finished session is exported, spooled, then queued."""

    def __init__(self, spool: Spool, config: ArlConfig) -> None:
        self.spool = spool
        self.config = config
        self.control: ProxyControl | None = None
        self.finished: asyncio.Queue[SpooledSession] = asyncio.Queue()
        self.saving = 0
        """Sessions being exported and spooled right now (they still occupy capacity)."""
        self.error: BaseException | None = None

    def subscribe(self, control: ProxyControl) -> EndHook:
        """The hook `open_services` subscribes to the proxy before it listens (no end can be missed)."""
        self.control = control
        return self.on_end

    async def on_end(self, event: SessionEnd) -> None:
        """Durable when this returns. Raises if export or spooling fails (the end call then answers 503) and
        remembers the error for `check` (the stage then stops)."""
        assert self.control is not None, "subscribe() first"
        status = "abandoned" if event.reason == "timeout" else event.run_status
        self.saving += 1
        try:
            record = await record_session(self.control, self.spool, self.config, event.session_id, status)
        except Exception as exc:
            self.error = self.error or exc
            log.exception("session %s ended but could not be exported and spooled", event.session_id)
            raise
        finally:
            self.saving -= 1
        self.finished.put_nowait(record)

    def check(self) -> None:
        if self.error is not None:
            raise ArlError(
                f"a finished outside session could not be exported and spooled ({self.error}); its end "
                "call answered 503. Fix the cause (disk full? proxy error in this log?) and restart the "
                "stage: every session it had spooled is kept."
            ) from self.error


async def record_session(
    control: ProxyControl, spool: Spool, config: ArlConfig, session_id: str, status: str
) -> SpooledSession:
    """Export one finished session and write it to the spool; durable when this returns."""
    cfg = config.rollout
    exported = await export_session(control, session_id, cfg.export_style, cfg.discount)
    if exported is None:  # the proxy refused (logged by export_session): recorded so the tally survives
        record = SpooledSession(session_id, "unexported", time.time())
    else:
        record = SpooledSession(
            session_id,
            status,
            time.time(),
            num_interactions=exported.num_interactions,
            prefix_breaks=exported.prefix_breaks,
            samples=tuple(exported.rows),
        )
    await asyncio.to_thread(spool.write, record)  # fsyncs: off the event loop, other sessions keep going
    return record


def count_session(record: SpooledSession, step: int, tally: StepTally) -> list[TrajectoryRow]:
    """Tally one finished session; its rows for the step (none unless it ended well)."""
    if record.status == "unexported":
        tally.add_error(f"external session {record.session_id} could not be exported", timed_out=False)
        return []
    if record.status in ("failed", "abandoned"):
        tally.add_error(f"external session {record.session_id} {record.status}", timed_out=False)
        return []
    rows = [row.at_step(step) for row in record.samples]
    tally.add_finished(
        rejected=record.status == "rejected",
        num_interactions=record.num_interactions,
        prefix_breaks=record.prefix_breaks,
        samples=len(rows),
    )
    return [] if record.status == "rejected" else rows


@dataclass
class Admission:
    """Capacity bookkeeping: grant slots only for steps the weight version allows (`newest_servable_step`)."""

    granted: int = 0

    def slots(
        self,
        *,
        step: int,
        version: int,
        max_staleness: int,
        num_steps: int,
        batch_size: int,
        buffered: int,
        in_flight: int,
        started_total: int,
    ) -> int:
        last_allowed = min(newest_servable_step(version, max_staleness), num_steps - 1)
        if last_allowed < step:
            return 0
        allowed = (last_allowed - step + 1) * batch_size - buffered
        outstanding = max(self.granted - started_total, 0)
        return max(allowed - in_flight - outstanding, 0)


@dataclass
class ExternalRun:
    """What the stage's step loop works with."""

    control: LocalControl | PoolControl
    subscriber: SpoolSubscriber
    spool: Spool
    paths: RunPaths
    config: ArlConfig
    sink: Any
    name: str
    admission: Admission = field(default_factory=Admission)
    check: Callable[[], None] = lambda: None
    """Raises if the proxy cannot go on (a pool's worker died)."""


async def admit(run: ExternalRun, step: int, buffered: int) -> None:
    """Top the proxy's capacity up to what the staleness bound allows right now."""
    counts, config = run.control.capacity, run.config
    count = run.admission.slots(
        step=step,
        version=published_version(run.paths),
        max_staleness=config.rollout.max_staleness,
        num_steps=config.num_steps,
        batch_size=config.rollout.batch_size,
        buffered=buffered,
        in_flight=counts.open + run.subscriber.saving,
        started_total=counts.started,
    )
    if count > 0:
        await run.control.grant_capacity(count)
        run.admission.granted += count


async def run_external(ctx: StageContext, *, name: str = "external") -> list[int]:
    """The `proxy` stage: serve the standalone proxy and publish steps of outside sessions until
    `num_steps` (or exactly `ctx.only_step`); return the steps published."""
    from pipeline.proxy.services import open_services

    config, paths, only_step = ctx.config, ctx.paths, ctx.only_step

    if not config.proxy.require_capacity:
        log.warning(
            "proxy.require_capacity is false: outside sessions are admitted regardless of the weight "
            "version; only the per-token staleness check applies"
        )
    steps = [only_step] if only_step is not None else missing_steps(paths, config.num_steps)
    spool = Spool(paths)
    subscriber = SpoolSubscriber(spool, config)
    for record in spool.load():  # before serving: no write of ours is under way while its leftovers are swept
        subscriber.finished.put_nowait(record)
    if subscriber.finished.qsize() and steps:
        log.info("%d finished sessions from %s count toward step %d", subscriber.finished.qsize(), spool.dir, steps[0])
    sink = open_sink(ctx)
    async with open_services(config, paths, name=name, subscribe=subscriber.subscribe) as services:
        try:
            run = ExternalRun(services.control, subscriber, spool, paths, config, sink, name, check=services.check)
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
    log.info(
        "step %d published from %d outside sessions: %d samples, reward mean %s, %d failed/abandoned",
        step,
        sessions,
        stats["samples"],
        stats["reward_mean"],
        tally.agent_errors,
    )


async def fill_step(run: ExternalRun, step: int, tally: StepTally) -> tuple[list[TrajectoryRow], list[str], int]:
    """Rows of the next finished sessions until `batch_size` of them had samples; every session id consumed."""
    subscriber = run.subscriber
    rows: list[TrajectoryRow] = []
    consumed: list[str] = []
    sessions = 0
    while sessions < run.config.rollout.batch_size:
        subscriber.check()
        run.check()
        await admit(run, step, sessions + subscriber.finished.qsize())
        try:
            record = await asyncio.wait_for(subscriber.finished.get(), 0.5)
        except TimeoutError:
            continue
        consumed.append(record.session_id)
        new = count_session(record, step, tally)
        if new:
            rows.extend(new)
            sessions += 1
    return rows, consumed, sessions


def publish_external_step(
    paths: RunPaths,
    config: ArlConfig,
    step: int,
    rows: list[TrajectoryRow],
    consumed: list[str],
    tally: StepTally,
    name: str,
) -> dict[str, Any]:
    """Filter and publish the step; its manifest lists `consumed` (what a restart must not count again)."""
    from pipeline.run.shards import write_step

    rows = filter_rows(rows, step, config, tally)
    stats = tally.summary(rows)
    rows.sort(key=sort_key)
    write_step(
        paths,
        step,
        rows,
        producer=f"proxy-{name}",
        tokenizer=config.model.tokenizer or config.model.path,
        extra={**stats, CONSUMED_KEY: consumed},
    )
    return stats
