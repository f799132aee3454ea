"""The rollout stage's loop: one complete, versioned step of trajectories at a time.

Per step k (`produce_step`): wait for weights of version >= max(k - max_staleness, 0) → run the step's
prompts × group_size through the agent (each run is one proxy session, driven in process through
`ProxyControl`: admitted through the capacity gate, rewarded, ended, exported as typed rows) →
filter (rejected runs, stale samples, constant groups) → check the error rate → publish shards +
manifest → record the cursor → log metrics. docs/rollout.md describes the loop.

Resume: the first step in [0, num_steps) without a manifest is redone whole (a step killed midway
left at most a staging dir, which `write_step` removes). `--step N` redoes exactly step N. The
prompts of a step depend only on k (see `pipeline.agents.dataset`), so both are exact.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from pipeline.agents.dataset import Prompt, PromptSource, Schedule, check_cursor, load_rows, write_cursor
from pipeline.agents.episode import SessionPlan, drive_session, make_executor, sort_key, with_agent_metrics
from pipeline.agents.loading import resolve_agent
from pipeline.agents.runner import Executor
from pipeline.errors import ArlError
from pipeline.eval.inrun import InRunEvaluation, pending_versions
from pipeline.eval.runner import Where
from pipeline.proxy.control import ProxyControl
from pipeline.rollout.progress_bar import StepProgress
from pipeline.rollout.staleness import split_stale, wait_for_version
from pipeline.rollout.stats import StepTally, drop_constant_groups
from pipeline.rollout.tasks import TaskMix, task_figures
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import MetricsSink
from pipeline.run.stage import StageContext
from pipeline.run.weight_version import oldest_usable_version
from schemas.config import ArlConfig
from schemas.trajectory import TrajectoryRow

log = logging.getLogger("arl.rollout")


class AgentErrorRate(ArlError):
    """More of a step's runs failed than `rollout.max_error_rate` allows."""


class NoModelCalls(ArlError):
    """Every agent run of a step finished without one model call: nothing to train on."""


@dataclass
class Rollout:
    """Everything one step needs; built once by `run_rollout`."""

    config: ArlConfig
    paths: RunPaths
    schedule: PromptSource
    executors: dict[str, Executor]
    """One per task (`default` for the one-task shorthand)."""
    control: ProxyControl
    proxy_url: str
    engine: Any
    sink: MetricsSink
    tokenizer: str


async def run_rollout(ctx: StageContext) -> list[int]:
    """The `rollout` stage: produce the missing steps (or exactly `ctx.only_step`); return the steps published."""
    from pipeline.proxy.services import open_services

    config, paths, only_step = ctx.config, ctx.paths, ctx.only_step

    schedule = build_schedule(config)
    check_cursor(paths.rollout_state, schedule)
    if only_step is not None and not 0 <= only_step < config.num_steps:
        raise ArlError(f"--step {only_step} is outside this run's steps 0..{config.num_steps - 1} (num_steps)")
    steps = [only_step] if only_step is not None else missing_steps(paths, config.num_steps)
    # In-run evaluation belongs to the run's own pass, not to a redo of one step (`--step N`).
    evaluations = pending_versions(paths, config) if only_step is None else []
    if not steps and not evaluations:
        log.info("all %d steps already have a manifest: nothing to do", config.num_steps)
        return []
    agents = {
        t.name: resolve_agent(t.agent, t.agent_kwargs, mode=config.rollout.mode) for t in config.rollout.task_list()
    }
    sink = open_sink(ctx)
    async with open_services(config, paths, name="rollout") as services:
        executors = {name: make_executor(agent, config, services.http) for name, agent in agents.items()}
        rollout = Rollout(
            config=config,
            paths=paths,
            schedule=schedule,
            executors=executors,
            control=services.control,
            proxy_url=services.proxy_url,
            engine=services.engine,
            sink=sink,
            tokenizer=config.model.tokenizer or config.model.path,
        )
        where = Where(services.control, services.proxy_url, services.http)
        evaluation = InRunEvaluation(config, paths, where, services.engine, evaluations) if evaluations else None
        try:
            if evaluation is not None:
                evaluation.start()
            for step in steps:
                await produce_step(rollout, step)
                if evaluation is not None:
                    evaluation.check()
            if evaluation is not None:
                await evaluation.finish()
        finally:
            if evaluation is not None:
                await evaluation.close()
            for executor in executors.values():
                await executor.close()
            sink.close()
    return steps


def build_schedule(config: ArlConfig) -> PromptSource:
    """The one-task schedule, or the mix of `rollout.tasks` (`pipeline.rollout.tasks`)."""
    cfg = config.rollout
    if cfg.tasks:
        return TaskMix(cfg.tasks, cfg.batch_size, cfg.task_seed)
    return Schedule(load_rows(cfg.dataset), cfg.batch_size, shuffle=cfg.dataset.shuffle, seed=cfg.dataset.seed)


def missing_steps(paths: RunPaths, num_steps: int) -> list[int]:
    """Steps from the first one without a manifest to the end (later manifests are redone too:
    they can only exist if someone redid a step by hand, and the schedule reproduces them exactly)."""
    done = set(paths.complete_steps())
    first = next((k for k in range(num_steps) if k not in done), num_steps)
    return [k for k in range(first, num_steps) if k not in done]


def open_sink(ctx: StageContext) -> MetricsSink:
    """`metrics/rollout.jsonl`, TensorBoard and (with `metrics.wandb`) this stage's W&B run, all under `rollout/`:
    the rollout and the standalone proxy stage write the same rows."""
    from pipeline.run.sinks import JsonlSink, MultiSink, TensorBoardSink, open_wandb

    paths = ctx.paths
    wandb = open_wandb(ctx.config, paths, ctx.name, prefix="rollout", redo_step=ctx.only_step)
    try:
        return MultiSink(
            JsonlSink(paths.rollout_metrics), TensorBoardSink(paths.tensorboard / "rollout", "rollout"), wandb
        )
    except ImportError as exc:  # tensorboard is optional at run time; the JSONL line is the record
        log.warning("TensorBoard unavailable (%s); metrics go to %s only", exc, paths.rollout_metrics)
        return MultiSink(JsonlSink(paths.rollout_metrics), wandb)


async def produce_step(ro: Rollout, step: int) -> None:
    """One step, start to published (the table of contents of the rollout)."""
    cfg = ro.config.rollout
    started, cpu_started = time.perf_counter(), time.process_time()
    version = await wait_for_version(
        ro.paths,
        oldest_usable_version(step, cfg.max_staleness),
        timeout_s=cfg.wait_timeout_s,
        engine_version=ro.engine.weight_version,
    )
    tally = StepTally(step, weight_version=version)
    tally.times["time_wait_weights_s"] = time.perf_counter() - started
    rows = await run_step_sessions(ro, step, ro.schedule.prompts(step), tally)
    tally.times["time_runs_s"] = time.perf_counter() - started - tally.times["time_wait_weights_s"]
    rows = filter_rows(rows, step, ro.config, tally)
    check_error_rate(tally, cfg.max_error_rate, step)
    check_model_calls(tally, step)
    written = time.perf_counter()
    publish_step(ro, step, rows, tally)
    stats = tally.summary(rows)
    if cfg.tasks:
        stats.update(task_figures(rows, [t.name for t in cfg.tasks]))
    # cpu_s: this process's CPU over the step (the proxy and inline agents included; subproc workers not).
    stats.update(
        time_write_s=time.perf_counter() - written,
        time_step_s=time.perf_counter() - started,
        cpu_s=time.process_time() - cpu_started,
    )
    ro.sink.log(step, stats)
    log.info(
        "step %d published: %d samples, reward mean %s, %d errors, %d rejected, %d stale dropped",
        step,
        stats["samples"],
        _fmt(stats["reward_mean"]),
        tally.agent_errors,
        tally.rejected,
        tally.dropped_stale,
    )


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
    256 slots) that made 3.4 start attempts per run, and the back-off left slots idle for up to a second. An in-run
    evaluation's slots are kept out of rollout's."""
    slots = config.proxy.max_sessions
    if config.eval.versions(config.num_steps):  # the in-run evaluation keeps its own slots (pipeline.eval.inrun)
        slots -= config.eval.concurrency()
    return min(config.rollout.max_concurrency, slots)


async def run_session(ro: Rollout, step: int, prompt: Prompt, run_index: int, tally: StepTally) -> list[TrajectoryRow]:
    """One agent run in its own proxy session; its samples (none if rejected or failed)."""
    cfg = ro.config.rollout
    metadata: dict[str, Any] = {
        "step": step,
        "dataset_index": prompt.index,
        "epoch": prompt.epoch,
        "position": prompt.position,
        "run_index": run_index,
    }
    group_id = f"step{step:06d}-p{prompt.position}"
    if cfg.tasks:  # positions count per task: the task names the group too
        metadata["task"] = prompt.task
        group_id = f"step{step:06d}-{prompt.task}-p{prompt.position}"
    plan = SessionPlan(group_id, metadata, cfg.run_timeout_s, cfg.temperature)
    executor = ro.executors[prompt.task]
    report, exported = await drive_session(ro.control, ro.proxy_url, executor, prompt.data, plan, ro.config)
    if report.outcome is None or exported is None:
        log.warning("agent run failed (session %s, dataset row %d):\n%s", plan.session_id, prompt.index, report.error)
        tally.add_error(report.error or "unknown error", timed_out=report.timed_out)
        return []
    rejected = report.outcome.rejected
    metrics = report.outcome.metrics
    samples = [with_agent_metrics(row, metrics).at_step(step) for row in exported.rows]
    tally.add_finished(
        rejected=rejected,
        num_interactions=exported.num_interactions,
        prefix_breaks=exported.prefix_breaks,
        samples=len(samples),
        metrics=metrics,
        first_call_s=exported.first_call_s,
        refusal=exported.last_refusal,
    )
    return [] if rejected else samples


def filter_rows(rows: list[TrajectoryRow], step: int, config: ArlConfig, tally: StepTally) -> list[TrajectoryRow]:
    """Drop samples older than the staleness bound and (if configured) groups with constant rewards."""
    rows, tally.dropped_stale = split_stale(rows, step, config.rollout.max_staleness)
    if tally.dropped_stale:
        log.warning(
            "step %d: dropped %d samples with tokens older than version %d",
            step,
            tally.dropped_stale,
            oldest_usable_version(step, config.rollout.max_staleness),
        )
    if config.rollout.drop_constant_groups:
        rows, tally.dropped_constant_groups, tally.dropped_constant_samples = drop_constant_groups(rows)
    return rows


def check_error_rate(tally: StepTally, max_rate: float, step: int) -> None:
    if tally.error_rate > max_rate:
        raise AgentErrorRate(
            f"step {step}: {tally.agent_errors} of {tally.runs} agent runs failed (error rate {tally.error_rate:.2f} > "
            f"rollout.max_error_rate={max_rate}); the last one:\n{tally.last_traceback}"
        )


def check_model_calls(tally: StepTally, step: int) -> None:
    """Stop before publishing a step no run called the model in: the trainer would only find no samples."""
    if not tally.runs or tally.no_call < tally.runs:
        return
    cause = (
        f"the proxy refused the last call it saw ({tally.no_call_refusal}), and the agent swallowed the error"
        if tally.no_call_refusal
        else "the proxy saw no call at all"
    )
    raise NoModelCalls(
        f"step {step}: {tally.no_call} of {tally.runs} agent runs made no model call, so there is nothing to train "
        f"on: {cause}. The agent must send its LLM calls to the base_url with the api_key it is given, and let "
        'its client\'s errors propagate (docs/rollout.md, "Agents")'
    )


def publish_step(ro: Rollout, step: int, rows: list[TrajectoryRow], tally: StepTally) -> None:
    """Shards and manifest (its `extra`: the step's statistics so far), then the dataset cursor."""
    from pipeline.run.shards import write_step

    rows.sort(key=sort_key)  # stable file order
    write_step(ro.paths, step, rows, producer="rollout", tokenizer=ro.tokenizer, extra=tally.summary(rows))
    datasets = ",".join(t.dataset.path for t in ro.config.rollout.task_list())
    write_cursor(ro.paths.rollout_state, ro.schedule, step, datasets)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
