"""In-run evaluation: the rollout stage evaluates the versions `eval.versions(num_steps)` (`eval.every`,
`eval.at_start`, and the last version) beside its steps, through its own proxy and the run's engines.

It runs as one asyncio task next to the step loop, with its own session slots (rollout keeps
`proxy.max_sessions` less the largest set's `max_concurrency`, `pipeline.rollout.loop.run_concurrency`), so
rollout never waits for it. For each version it waits until the engines serve that version, evaluates every
set not yet recorded (`pipeline.eval.runner`) and records each (`pipeline.eval.results`). The trainer holds
the next publication until then (`pipeline.eval.hold`), so the weights do not change under an evaluation;
every row still carries the version of each sampled token, and a set whose tokens show another version (the
hold ran out) is not recorded but reported.

Resume: what is recorded is the set's complete shards. A restarted rollout stage evaluates every due version
whose sets are not all recorded, if the engines still serve it (the trainer's hold keeps them there), and
reports the ones they no longer serve; nothing is evaluated twice, none is skipped silently.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pipeline.engine.client.wire import EngineError
from pipeline.errors import WaitTimeout
from pipeline.eval.hold import evaluated
from pipeline.eval.results import is_recorded, open_sinks, record, restore_lines, sink_figures
from pipeline.eval.runner import SetResult, Where, evaluate_set
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import MetricsSink
from pipeline.run.weight_version import published_version
from schemas.config import ArlConfig

log = logging.getLogger("arl.eval")

_POLL_S = 0.25


def pending_versions(paths: RunPaths, config: ArlConfig) -> list[int]:
    """Due versions not yet evaluated in full (after restoring the metrics lines a kill may have cut)."""
    versions = config.eval.versions(config.num_steps)
    restore_lines(paths, config, versions)
    return [v for v in versions if not evaluated(paths, config, v)]


class InRunEvaluation:
    """The evaluation task of one rollout stage (module docstring). `start`, then `check` after each step (it
    raises the task's error), `finish` after the last step (waits, within `rollout.wait_timeout_s` for each
    version still to be published), `close` always."""

    def __init__(self, config: ArlConfig, paths: RunPaths, where: Where, engine: Any, versions: list[int]) -> None:
        self.config, self.paths, self.where, self.engine = config, paths, where, engine
        self.versions = versions
        self.finish_deadline: float | None = None
        self.task: asyncio.Task[None] | None = None
        self.sinks: MetricsSink | None = None

    def start(self) -> None:
        self.sinks = open_sinks(self.paths, self.config)
        self.task = asyncio.create_task(self._run(), name="in-run evaluation")

    def check(self) -> None:
        if self.task is not None and self.task.done():
            self.task.result()

    async def finish(self) -> None:
        self.finish_deadline = asyncio.get_running_loop().time() + self.config.rollout.wait_timeout_s
        if self.task is not None:
            await self.task

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.sinks is not None:
            self.sinks.close()

    async def _run(self) -> None:
        for version in self.versions:
            served = await self._served_at_least(version)
            if served > version:
                log.warning(
                    "version %d is not evaluated: the engines already serve version %d (its evaluation was "
                    "not recorded before the trainer went on); `arl eval RUN_DIR --step %d` evaluates its "
                    "checkpoint offline if it is kept",
                    version,
                    served,
                    version,
                )
                continue
            await self._evaluate(version)

    async def _evaluate(self, version: int) -> None:
        for spec in self.config.eval.sets:
            if is_recorded(self.paths, version, spec.name):
                continue
            result = await evaluate_set(spec, self.config, self.where, version)
            foreign = sorted({v for row in result.rows for v in row.versions if v >= 0 and v != version})
            if foreign:
                log.warning(
                    "evaluation of version %d on %s is not recorded: some of its tokens were sampled by "
                    "version(s) %s (the trainer published during it: eval.hold_timeout_s ran out)",
                    version,
                    spec.name,
                    foreign,
                )
                continue
            record(self.paths, self.config, result, f"engines at version {version}")
            if self.sinks is not None:
                self.sinks.log(version, sink_figures(result))
            log.info("%s", summary_line(result))

    async def _served_at_least(self, version: int) -> int:
        """The version the engines serve, once it is at least `version` (published and reported by them)."""
        loop = asyncio.get_running_loop()
        while True:
            published = published_version(self.paths)
            if published >= version:
                try:
                    return min(published, await self.engine.weight_version())
                except EngineError:
                    pass  # none answering (restarting): waited out like an older version
            if self.finish_deadline is not None and loop.time() > self.finish_deadline:
                raise WaitTimeout(
                    f"the evaluation of version {version} waited {self.config.rollout.wait_timeout_s:.0f}s after the "
                    f"last step for that version in {self.paths.weight_version} (published: {published}), produced "
                    f"by the train stage; see its log: {self.paths.latest_log('train')}"
                )
            await asyncio.sleep(_POLL_S)


def summary_line(result: SetResult) -> str:
    f = result.figures
    extra = " · ".join(
        f"{k} {v:.3f}" for k, v in sorted(f.items()) if k.startswith(("pass@", "agent/")) and isinstance(v, int | float)
    )
    reward = "n/a" if f.get("reward_mean") is None else f"{f['reward_mean']:.3f}"
    return (
        f"evaluation of version {result.version} on {result.name}: reward {reward}"
        + (f" · {extra}" if extra else "")
        + f" ({f.get('prompts')} prompts x {f.get('num_samples')})"
    )
