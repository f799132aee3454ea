"""Run one evaluation set through the proxy: every prompt `num_samples` times, each run its own session.

A run goes the way a rollout run does (`pipeline.agents.episode.drive_session`: admitted, the agent, rewards,
end, export), with two differences: the session imposes the set's sampling on every call (`SamplingOverride`: greedy by
default for one sample, whatever temperature the agent sends), and nothing it produces is a training
sample: the exported rows are written as the evaluation's own shards, never under `trajectories/`.

A run's reward is the number the agent returned; for a dict of rewards by completion, their mean; for `{}`
(rewards set through `/rl/set_reward`), the mean reward of its exported rows. A run that fails, times out or
is rejected has none and no success.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from dataclasses import dataclass
from typing import Any

from pipeline.agents.dataset import load_rows
from pipeline.agents.episode import SessionPlan, drive_session, make_executor, with_agent_metrics
from pipeline.agents.loading import resolve_agent
from pipeline.agents.outcome import Outcome
from pipeline.agents.runner import Executor
from pipeline.eval.scores import RunResult, summarize
from pipeline.proxy.control import ExportedSession, ProxyControl
from schemas.api.rl import SamplingOverride
from schemas.config import ArlConfig, DatasetConfig, EvalSetConfig
from schemas.trajectory import TrajectoryRow

log = logging.getLogger("arl.eval")


@dataclass
class SetResult:
    """One set evaluated on one weight version: its figures, its runs and its exported rows."""

    name: str
    version: int
    figures: dict[str, Any]
    runs: list[RunResult]
    rows: list[TrajectoryRow]


@dataclass(frozen=True)
class Where:
    """The proxy an evaluation talks to: its in-process control, its URL and the agents' HTTP client."""

    control: ProxyControl
    proxy_url: str
    http: Any


@dataclass(frozen=True)
class _SetRuns:
    """What every run of one set shares."""

    spec: EvalSetConfig
    """The set."""
    config: ArlConfig
    """The run's configuration (the agent's defaults, the export style)."""
    where: Where
    """The proxy the sessions go through."""
    executor: Executor
    """Runs the set's agent."""
    sampling: SamplingOverride
    """The sampling the sessions impose on every call."""
    version: int
    """The weight version evaluated."""


def set_sampling(spec: EvalSetConfig, config: ArlConfig) -> SamplingOverride:
    return SamplingOverride(
        temperature=spec.effective_temperature(config.rollout.temperature), top_p=spec.top_p, max_tokens=spec.max_tokens
    )


def set_agent_kwargs(spec: EvalSetConfig, config: ArlConfig) -> dict[str, Any]:
    if spec.agent_kwargs is not None:
        return spec.agent_kwargs
    return config.rollout.agent_kwargs if spec.agent in (None, config.rollout.agent) else {}


async def evaluate_set(spec: EvalSetConfig, config: ArlConfig, where: Where, version: int) -> SetResult:
    """Every prompt of the set, `num_samples` runs each, at most `max_concurrency` at once; scored."""
    rows_in = load_rows(DatasetConfig(path=spec.path, split=spec.split, shuffle=False))
    count = min(len(rows_in), spec.limit) if spec.limit is not None else len(rows_in)
    agent = resolve_agent(spec.agent or config.rollout.agent, set_agent_kwargs(spec, config), mode=config.rollout.mode)
    executor = make_executor(agent, config, where.http)
    sampling = set_sampling(spec, config)
    limit = asyncio.Semaphore(spec.max_concurrency)
    shared = _SetRuns(spec=spec, config=config, where=where, executor=executor, sampling=sampling, version=version)

    async def one(index: int, sample: int) -> tuple[RunResult, list[TrajectoryRow]]:
        async with limit:
            return await _run(shared, rows_in[index], index, sample)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, s)) for i in range(count) for s in range(spec.num_samples)]
    finally:
        await executor.close()
    runs = [task.result()[0] for task in tasks]
    rows = [row for task in tasks for row in task.result()[1]]
    figures = summarize(runs, ks=spec.ks(), success_metric=spec.success_metric, success_reward=spec.success_reward)
    figures.update(temperature=sampling.temperature, num_samples=spec.num_samples, samples=len(rows))
    return SetResult(spec.name, version, figures, runs, rows)


async def _run(
    shared: _SetRuns, data: dict[str, Any], index: int, sample: int
) -> tuple[RunResult, list[TrajectoryRow]]:
    """Run `sample` of the set's row `index` (`data`): its result, and its exported rows at the evaluated version."""
    spec, sampling, version = shared.spec, shared.sampling, shared.version
    metadata = {"eval_set": spec.name, "dataset_index": index, "run_index": sample, "version": version}
    temperature = sampling.temperature if sampling.temperature is not None else 1.0
    plan = SessionPlan(f"eval-{spec.name}-v{version}-p{index}", metadata, spec.run_timeout_s, temperature, sampling)
    where = shared.where
    report, exported = await drive_session(where.control, where.proxy_url, shared.executor, data, plan, shared.config)
    outcome = report.outcome
    if outcome is None or outcome.rejected or exported is None:
        why = "rejected by the agent" if outcome is not None and outcome.rejected else report.error
        log.warning("eval set %s, row %d, run %d yields no result: %s", spec.name, index, sample, why)
        return RunResult(index, None, {}, why or "the session could not be exported"), []
    rows = [with_agent_metrics(row, outcome.metrics).at_step(version) for row in exported.rows]
    return RunResult(index, run_reward(outcome, exported), dict(outcome.metrics)), rows


def run_reward(outcome: Outcome, exported: ExportedSession) -> float | None:
    """The run's reward (module docstring): the returned number, else the mean of the returned or set rewards."""
    if outcome.reward is not None:
        return outcome.reward
    if outcome.rewards:
        return statistics.fmean(outcome.rewards.values())
    rewards = [row.reward for row in exported.rows]
    return statistics.fmean(rewards) if rewards else None
