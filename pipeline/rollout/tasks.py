"""Several tasks in one run (`rollout.tasks`): which task's prompts each step holds, and the figures per task.

The draw (the reason resume stays exact): step k draws the task of each of its `batch_size` prompts from the
tasks' weights with a generator seeded by `(rollout.task_seed, k)`, so a step's counts per task depend only on
k and the config. Each task keeps its own prompt sequence (`Schedule`: its dataset's epochs in its own seeded
order), and a task's prompts in step k are the next `count` positions of that sequence: those after the
prompts it held in steps 0..k-1. So step k is the same whether the run went straight through, was resumed
after `kill -9`, or step k is redone with `--step k`. Over many steps each task's share of the prompts tends
to its weight's share (a multinomial draw per step, not a rounding: small weights still get their turn).

A group never mixes tasks: a group is one prompt's `group_size` runs. Every row carries its task in its
metadata (`metadata.task`), which `arl inspect --task` and the per-task figures read.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import numpy as np

from pipeline.agents.dataset import Prompt, Schedule, load_rows
from schemas.config import TaskConfig
from schemas.config.rollout import task_of
from schemas.trajectory import TrajectoryRow


class TaskMix:
    """The prompts of each step across several tasks (module docstring); a `PromptSource`."""

    def __init__(self, tasks: list[TaskConfig], batch_size: int, seed: int) -> None:
        self.tasks = tasks
        self.names = [t.name for t in tasks]
        self.schedules = [
            Schedule(load_rows(t.dataset), 1, shuffle=t.dataset.shuffle, seed=t.dataset.seed) for t in tasks
        ]
        weights = np.array([t.weight for t in tasks], dtype=np.float64)
        self.shares = weights / weights.sum()
        self.batch_size = batch_size
        self.seed = seed
        self._before = [np.zeros(len(tasks), dtype=np.int64)]
        """`_before[k]`: each task's prompts in steps 0..k-1 (grown on demand)."""

    def counts(self, step: int) -> np.ndarray:
        """Each task's prompts in `step`."""
        rng = np.random.default_rng([self.seed, step])
        return np.bincount(rng.choice(len(self.names), size=self.batch_size, p=self.shares), minlength=len(self.names))

    def before(self, step: int) -> np.ndarray:
        while len(self._before) <= step:
            self._before.append(self._before[-1] + self.counts(len(self._before) - 1))
        return self._before[step]

    def prompts(self, step: int) -> list[Prompt]:
        out = []
        counts, before = self.counts(step), self.before(step)
        for task, (name, schedule) in enumerate(zip(self.names, self.schedules, strict=True)):
            start = int(before[task])
            for position in range(start, start + int(counts[task])):
                epoch, index = schedule.locate(position)
                out.append(Prompt(position=position, epoch=epoch, index=index, data=schedule.rows[index], task=name))
        return out

    def fingerprint(self) -> dict[str, Any]:
        tasks = [
            {"name": t.name, "dataset_len": s.size, "weight": t.weight, "shuffle": s.shuffle, "seed": s.seed}
            for t, s in zip(self.tasks, self.schedules, strict=True)
        ]
        return {"tasks": tasks, "batch_size": self.batch_size, "task_seed": self.seed}

    def cursor(self, step: int) -> dict[str, Any]:
        return {"next_positions": dict(zip(self.names, map(int, self.before(step + 1)), strict=True))}


def task_figures(rows: list[TrajectoryRow], names: list[str]) -> dict[str, float | int | None]:
    """`task/<name>/samples`, `.../reward_mean`, and the mean of each agent metric over the task's samples."""
    by_task: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for row in rows:
        metadata = json.loads(row.metadata)
        by_task.setdefault(task_of(metadata), []).append({"reward": row.reward, **metadata})
    figures: dict[str, float | int | None] = {}
    for name, samples in by_task.items():
        figures[f"task/{name}/samples"] = len(samples)
        figures[f"task/{name}/reward_mean"] = statistics.fmean(s["reward"] for s in samples) if samples else None
        metrics = sorted({k for s in samples for k in s.get("metrics", {})})
        for key in metrics:
            values = [float(s["metrics"][key]) for s in samples if key in s.get("metrics", {})]
            figures[f"task/{name}/agent/{key}"] = statistics.fmean(values)
    return figures
