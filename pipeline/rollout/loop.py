"""The rollout stage's loop: one complete, versioned step of trajectories at a time.

Per step k (`produce_step`): wait for weights of version >= k - max_staleness → run the step's
prompts × group_size through the agent (each run is one proxy session, driven in process through
`ProxyControl`: admitted through the capacity gate, rewarded, ended, exported as typed rows) →
filter (rejected runs, stale samples, constant groups) → check the error rate → publish shards +
manifest → record the cursor → log metrics. docs/rollout.md describes the loop.

Resume: the first step in [0, num_steps) without a manifest is redone whole (a step killed midway
left at most a staging dir, which `write_step` removes). `--step N` redoes exactly step N. The
prompts of a step depend only on k (see `pipeline.rollout.data`), so both are exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from pipeline.errors import ArlError
from pipeline.metrics import MetricsSink
from pipeline.paths import RunPaths
from pipeline.proxy.control import ExportedSession, NoCapacity, ProxyAPIError, ProxyControl, SessionInfo
from pipeline.rollout.agents import Agent, resolve_agent
from pipeline.rollout.data import Prompt, Schedule, check_cursor, load_rows, write_cursor
from pipeline.rollout.metrics import StepTally, drop_constant_groups
from pipeline.rollout.progress import StepProgress
from pipeline.rollout.runner import Executor, InlineExecutor, RunContext, RunReport, SubprocExecutor
from pipeline.rollout.staleness import required_version, split_stale, wait_for_version
from pipeline.stage import StageContext
from schemas.api.rl import SamplingOverride
from schemas.config import ArlConfig
from schemas.trajectory import TrajectoryRow

log = logging.getLogger("arl.rollout")


class AgentErrorRate(ArlError):
    """More of a step's runs failed than `rollout.max_error_rate` allows."""


@dataclass
class Rollout:
    """Everything one step needs; built once by `run_rollout`."""

    config: ArlConfig
    paths: RunPaths
    schedule: Schedule
    executor: Executor
    control: ProxyControl
    proxy_url: str
    engine: Any
    sink: MetricsSink
    tokenizer: str


async def run_rollout(ctx: StageContext) -> list[int]:
    """The `rollout` stage: produce the missing steps (or exactly `ctx.only_step`); return the steps published."""
    from pipeline.rollout.services import open_services

    config, paths, only_step = ctx.config, ctx.paths, ctx.only_step

    schedule = build_schedule(config)
    check_cursor(paths.rollout_state, schedule)
    if only_step is not None and not 0 <= only_step < config.num_steps:
        raise ArlError(f"--step {only_step} is outside this run's steps 0..{config.num_steps - 1} (num_steps)")
    steps = [only_step] if only_step is not None else missing_steps(paths, config.num_steps)
    if not steps:
        log.info("all %d steps already have a manifest: nothing to do", config.num_steps)
        return []
    agent = resolve_agent(config.rollout.agent, config.rollout.agent_kwargs, mode=config.rollout.mode)
    sink = open_sink(ctx)
    async with open_services(config, paths, name="rollout") as services:
        executor = make_executor(agent, config, services.http)
        rollout = Rollout(config, paths, schedule, executor, services.control, services.proxy_url,
                          services.engine, sink, config.model.tokenizer or config.model.path)  # fmt: skip
        try:
            for step in steps:
                await produce_step(rollout, step)
        finally:
            await executor.close()
            sink.close()
    return steps


def build_schedule(config: ArlConfig) -> Schedule:
    dataset = config.rollout.dataset
    return Schedule(load_rows(dataset), config.rollout.batch_size, shuffle=dataset.shuffle, seed=dataset.seed)


def missing_steps(paths: RunPaths, num_steps: int) -> list[int]:
    """Steps from the first one without a manifest to the end (later manifests are redone too:
    they can only exist if someone redid a step by hand, and the schedule reproduces them exactly)."""
    done = set(paths.complete_steps())
    first = next((k for k in range(num_steps) if k not in done), num_steps)
    return [k for k in range(first, num_steps) if k not in done]


def make_executor(agent: Agent, config: ArlConfig, http: Any) -> Executor:
    if config.rollout.mode == "subproc":
        return SubprocExecutor(agent, config.rollout.subproc_workers)
    return InlineExecutor(agent, http)


def open_sink(ctx: StageContext) -> MetricsSink:
    """`metrics/rollout.jsonl`, TensorBoard and (with `metrics.wandb`) this stage's W&B run, all under `rollout/`:
    the rollout and the standalone proxy stage write the same rows."""
    from pipeline.metrics import JsonlSink, MultiSink, TensorBoardSink, open_wandb

    paths = ctx.paths
    wandb = open_wandb(ctx.config, paths, ctx.name, prefix="rollout", redo_step=ctx.only_step)
    try:
        return MultiSink(JsonlSink(paths.rollout_metrics), TensorBoardSink(paths.tensorboard / "rollout", "rollout"),
                         wandb)  # fmt: skip
    except ImportError as exc:  # tensorboard is optional at run time; the JSONL line is the record
        log.warning("TensorBoard unavailable (%s); metrics go to %s only", exc, paths.rollout_metrics)
        return MultiSink(JsonlSink(paths.rollout_metrics), wandb)


async def produce_step(ro: Rollout, step: int) -> None:
    """One step, start to published (the table of contents of the rollout)."""
    cfg = ro.config.rollout
    started, cpu_started = time.perf_counter(), time.process_time()
    version = await wait_for_version(ro.paths, required_version(step, cfg.max_staleness),
                                     timeout_s=cfg.wait_timeout_s, engine_version=ro.engine.weight_version)  # fmt: skip
    tally = StepTally(step, weight_version=version)
    tally.times["time_wait_weights_s"] = time.perf_counter() - started
    rows = await run_step_sessions(ro, step, ro.schedule.prompts(step), tally)
    tally.times["time_runs_s"] = time.perf_counter() - started - tally.times["time_wait_weights_s"]
    rows = filter_rows(rows, step, ro.config, tally)
    check_error_rate(tally, cfg.max_error_rate, step)
    written = time.perf_counter()
    publish_step(ro, step, rows, tally)
    stats = tally.summary(rows)
    # cpu_s: this process's CPU over the step (the proxy and inline agents included; subproc workers not).
    stats.update(time_write_s=time.perf_counter() - written, time_step_s=time.perf_counter() - started,
                 cpu_s=time.process_time() - cpu_started)  # fmt: skip
    ro.sink.log(step, stats)
    log.info("step %d published: %d samples, reward mean %s, %d errors, %d rejected, %d stale dropped",
             step, stats["samples"], _fmt(stats["reward_mean"]), tally.agent_errors, tally.rejected,
             tally.dropped_stale)  # fmt: skip


async def run_step_sessions(ro: Rollout, step: int, prompts: list[Prompt], tally: StepTally) -> list[TrajectoryRow]:
    """batch_size × group_size runs, at most `max_concurrency` at once; the exported rows of them all."""
    cfg = ro.config.rollout
    limit = asyncio.Semaphore(run_concurrency(ro.config))
    progress = StepProgress(step, len(prompts) * cfg.group_size)

    async def one(prompt: Prompt, run_index: int) -> list[TrajectoryRow]:
        async with limit:
            rows = await run_session(ro, step, prompt, run_index, tally)
        progress.advance(tally)
        return rows

    try:
        # A TaskGroup (unlike gather) cancels the other runs when one fails the whole step.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(p, r)) for p in prompts for r in range(cfg.group_size)]
    finally:
        progress.close()
    return [row for task in tasks for row in task.result()]


def run_concurrency(config: ArlConfig) -> int:
    """Runs in flight at once: `rollout.max_concurrency`, but no more than the proxy has session slots. Runs past
    `proxy.max_sessions` would only be refused (429) and retry with back-off: measured on the demo (512 runs a step,
    256 slots) that made 3.4 start attempts per run, and the back-off left slots idle for up to a second."""
    return min(config.rollout.max_concurrency, config.proxy.max_sessions)


async def run_session(ro: Rollout, step: int, prompt: Prompt, run_index: int, tally: StepTally) -> list[TrajectoryRow]:
    """One agent run in its own proxy session; its samples (none if rejected or failed)."""
    cfg = ro.config.rollout
    metadata = {"step": step, "dataset_index": prompt.index, "epoch": prompt.epoch,
                "position": prompt.position, "run_index": run_index}  # fmt: skip
    plan = SessionPlan(f"step{step:06d}-p{prompt.position}", metadata, cfg.run_timeout_s, cfg.temperature)
    report, exported = await drive_session(ro.control, ro.proxy_url, ro.executor, prompt.data, plan, ro.config)
    if report.outcome is None or exported is None:
        log.warning("agent run failed (session %s, dataset row %d):\n%s", plan.session_id, prompt.index,
                    report.error)  # fmt: skip
        tally.add_error(report.error or "unknown error", timed_out=report.timed_out)
        return []
    rejected = report.outcome.rejected
    metrics = report.outcome.metrics
    samples = [with_agent_metrics(row, metrics).at_step(step) for row in exported.rows]
    tally.add_finished(rejected=rejected, num_interactions=exported.num_interactions,
                       prefix_breaks=exported.prefix_breaks, samples=len(samples), metrics=metrics,
                       first_call_s=exported.first_call_s)  # fmt: skip
    return [] if rejected else samples


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


async def drive_session(control: ProxyControl, proxy_url: str, executor: Executor, data: dict[str, Any],
                        plan: SessionPlan, config: ArlConfig) -> tuple[RunReport, ExportedSession | None]:  # fmt: skip
    """One run, the way rollout and evaluation both do it: admitted, the agent, rewards, end, export. The report
    carries an error when the session could not be exported (the run is then lost, not the step)."""
    session = await admit_session(control, plan.group_id, plan.metadata, plan.timeout_s, plan.sampling)
    plan.session_id = session.session_id
    report = await executor.run(data, RunContext(proxy_url, session, plan.temperature), plan.timeout_s)
    report = await apply_rewards(control, session.session_id, report)
    await end_quietly(control, session.session_id)
    exported = await export_session(control, session.session_id, config.rollout.export_style,
                                    config.rollout.discount)  # fmt: skip
    if exported is None:
        report = RunReport(None, report.error or "the session could not be exported (see the warning above)",
                           report.timed_out, report.duration_s)  # fmt: skip
    return report, exported


def with_agent_metrics(row: TrajectoryRow, metrics: dict[str, float]) -> TrajectoryRow:
    """The row with the run's agent metrics under `metrics` in its metadata (each sample of the run carries
    them, so a reader of one shard row sees what the agent measured)."""
    if not metrics:
        return row
    metadata = json.loads(row.metadata)
    metadata["metrics"] = metrics
    return dataclasses.replace(row, metadata=json.dumps(metadata, sort_keys=True, default=str))


async def admit_session(control: ProxyControl, group_id: str, metadata: dict[str, Any], patience_s: float,
                        sampling: SamplingOverride | None = None) -> SessionInfo:  # fmt: skip
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
                raise ArlError(f"the proxy refused new sessions for {patience_s:g}s ({exc}); raise proxy.max_sessions "
                               "above rollout.max_concurrency") from exc  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def export_session(control: ProxyControl, session_id: str, style: str,
                         discount: float) -> ExportedSession | None:  # fmt: skip
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


def filter_rows(rows: list[TrajectoryRow], step: int, config: ArlConfig, tally: StepTally) -> list[TrajectoryRow]:
    """Drop samples older than the staleness bound and (if configured) groups with constant rewards."""
    rows, tally.dropped_stale = split_stale(rows, step, config.rollout.max_staleness)
    if tally.dropped_stale:
        log.warning("step %d: dropped %d samples with tokens older than version %d", step, tally.dropped_stale,
                    required_version(step, config.rollout.max_staleness))  # fmt: skip
    if config.rollout.drop_constant_groups:
        rows, tally.dropped_constant_groups, tally.dropped_constant_samples = drop_constant_groups(rows)
    return rows


def check_error_rate(tally: StepTally, max_rate: float, step: int) -> None:
    if tally.error_rate > max_rate:
        raise AgentErrorRate(
            f"step {step}: {tally.agent_errors} of {tally.runs} agent runs failed (error rate {tally.error_rate:.2f} > "
            f"rollout.max_error_rate={max_rate}); the last one:\n{tally.last_traceback}"
        )


def publish_step(ro: Rollout, step: int, rows: list[TrajectoryRow], tally: StepTally) -> None:
    """Shards and manifest (its `extra`: the step's statistics so far), then the dataset cursor."""
    from pipeline.shards import write_step

    rows.sort(key=sort_key)  # stable file order
    write_step(ro.paths, step, rows, producer="rollout", tokenizer=ro.tokenizer, extra=tally.summary(rows))
    write_cursor(ro.paths.rollout_state, ro.schedule, step, ro.config.rollout.dataset.path)


def sort_key(row: TrajectoryRow) -> tuple[str, str, str]:
    """The order rows are written in: by group, session, sample (deterministic files for a step)."""
    return row.group_id, row.session_id, row.sample_id


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
