"""One agent run as a proxy session, the way rollout and evaluation both drive it: admitted through the capacity
gate, the agent, its rewards, the session's end, the export (`drive_session`); and the helpers around it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from pipeline.agents.loading import Agent
from pipeline.agents.runner import Executor, InlineExecutor, RunContext, RunReport, SubprocExecutor
from pipeline.errors import ArlError
from pipeline.proxy.control import ExportedSession, NoCapacity, ProxyAPIError, ProxyControl, SessionInfo
from schemas.api.rl import SamplingOverride
from schemas.config import ArlConfig
from schemas.trajectory import TrajectoryRow

log = logging.getLogger("arl.rollout")


@dataclass
class SessionPlan:
    """What one run's session is: its group, metadata, deadline, the temperature the agent is told, and any
    sampling the session imposes (evaluation's). `session_id` is filled in once the proxy admits it."""

    group_id: str
    metadata: dict[str, Any]
    timeout_s: float
    temperature: float
    sampling: SamplingOverride | None = None
    session_id: str = ""


async def drive_session(
    control: ProxyControl,
    proxy_url: str,
    executor: Executor,
    data: dict[str, Any],
    plan: SessionPlan,
    config: ArlConfig,
) -> tuple[RunReport, ExportedSession | None]:
    """One run, the way rollout and evaluation both do it: admitted, the agent, rewards, end, export. The report
    carries an error when the session could not be exported (the run is then lost, not the step)."""
    session = await admit_session(control, plan.group_id, plan.metadata, plan.timeout_s, plan.sampling)
    plan.session_id = session.session_id
    # A pool of proxy workers serves each session on its own worker: the agent gets that worker's URL.
    context = RunContext(session.url or proxy_url, session, plan.temperature)
    report = await executor.run(data, context, plan.timeout_s)
    report = await apply_rewards(control, session.session_id, report)
    await end_quietly(control, session.session_id)
    exported = await export_session(control, session.session_id, config.rollout.export_style, config.rollout.discount)
    if exported is None:
        report = RunReport(
            None,
            report.error or "the session could not be exported (see the warning above)",
            report.timed_out,
            report.duration_s,
        )
    return report, exported


def with_agent_metrics(row: TrajectoryRow, metrics: dict[str, float]) -> TrajectoryRow:
    """The row with the run's agent metrics under `metrics` in its metadata (each sample of the run carries
    them, so a reader of one shard row sees what the agent measured)."""
    if not metrics:
        return row
    metadata = json.loads(row.metadata)
    metadata["metrics"] = metrics
    return dataclasses.replace(row, metadata=json.dumps(metadata, sort_keys=True, default=str))


async def admit_session(
    control: ProxyControl,
    group_id: str,
    metadata: dict[str, Any],
    patience_s: float,
    sampling: SamplingOverride | None = None,
) -> SessionInfo:
    """Grant one unit of capacity and start the session (with `sampling` imposed on its calls, if given); retry
    briefly while the proxy is full (429)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    delay = 0.05
    await control.grant_capacity()
    while True:
        try:
            return await control.start_session(group_id, metadata, sampling)
        except NoCapacity as exc:
            if loop.time() > deadline:
                raise ArlError(
                    f"the proxy refused new sessions for {patience_s:g}s ({exc}); raise proxy.max_sessions "
                    "above rollout.max_concurrency"
                ) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def export_session(control: ProxyControl, session_id: str, style: str, discount: float) -> ExportedSession | None:
    """Export a session; None if the proxy refuses it (the run is then lost, not the step).

    In process (`LocalControl`) the export first waits, with a deadline, for calls of the session
    still in flight, e.g. after a timed-out agent was cancelled mid-request.
    """
    try:
        return await control.export(session_id, style=style, discount=discount)
    except ProxyAPIError as exc:
        if not exc.refused:
            raise
        log.warning("session %s could not be exported; its run yields no samples: %s", session_id, exc)
        return None


async def apply_rewards(control: ProxyControl, session_id: str, report: RunReport) -> RunReport:
    """Give the proxy the agent's returned rewards; a reward the proxy refuses fails the run."""
    outcome = report.outcome
    if outcome is None or outcome.rejected:
        return report
    try:
        if outcome.reward is not None:
            await control.set_reward(session_id, outcome.reward)
        for interaction_id, reward in outcome.rewards.items():
            await control.set_reward(session_id, reward, interaction_id)
    except ProxyAPIError as exc:
        if not exc.refused:
            raise
        if outcome.reward is not None and not outcome.rewards:
            return report  # a float for a run without LLM calls: counted as an empty run after export
        return RunReport(None, f"the proxy refused the agent's rewards: {exc}", False, report.duration_s)
    return report


async def end_quietly(control: ProxyControl, session_id: str) -> None:
    """End the session; an agent may already have ended it itself (a no-op then, or a 4xx over HTTP)."""
    try:
        await control.end_session(session_id)
    except ProxyAPIError as exc:
        if not exc.refused:
            raise
        log.debug("end_session for %s answered %s", session_id, exc.status)


def make_executor(agent: Agent, config: ArlConfig, http: Any) -> Executor:
    if config.rollout.mode == "subproc":
        return SubprocExecutor(agent, config.rollout.subproc_workers)
    return InlineExecutor(agent, http)


def sort_key(row: TrajectoryRow) -> tuple[str, str, str]:
    """The order rows are written in: by group, session, sample (deterministic files for a step)."""
    return row.group_id, row.session_id, row.sample_id
