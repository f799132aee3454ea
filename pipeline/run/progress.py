"""What a person watches of a run, one step at a time: the step lines, the demo's table, `arl status`.

Every place reads the same two files (`metrics/rollout.jsonl`, written when step k's trajectories
are published; `metrics/train.jsonl`, written when step k is trained into weight version k+1)
and shows the same columns under the same names. Steps are numbered as their directories
(`trajectories/step_k`, docs/run-directory.md "Steps, versions and checkpoint numbering"): a run
of `num_steps` N has steps 0 .. N-1 and ends at weight version N.

`StepFeed` follows both files as they grow (reading only what was appended) and hands out each
step once, when it is trained: `arl launch --executor local` and `arl demo` print one `step_line`
per step as it happens, so a pipe or a Slurm log shows the run's progress, not only its end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.run.console import fit_columns, table_width
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl


@dataclass(frozen=True)
class StepRecord:
    """One step's two metrics rows ({} for a row not written yet)."""

    step: int
    rollout: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)

    @property
    def trained(self) -> bool:
        return bool(self.train)

    def number(self, source: str, key: str) -> float | None:
        value = (self.rollout if source == "rollout" else self.train).get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    @property
    def reward(self) -> float | None:
        reward = self.number("rollout", "reward_mean")
        return reward if reward is not None else self.number("train", "reward_mean")

    def task_rewards(self) -> dict[str, float]:
        """Mean reward per task (`task/<name>/reward_mean`, runs with `rollout.tasks`), in the row's order."""
        return {
            key.split("/")[1]: float(value)
            for key, value in self.rollout.items()
            if key.startswith("task/")
            and key.endswith("/reward_mean")
            and key.count("/") == 2
            and isinstance(value, int | float)
        }

    @property
    def sampled_per_sample(self) -> float | None:
        sampled, samples = self.number("rollout", "sampled_tokens"), self.number("rollout", "samples")
        return sampled / samples if sampled is not None and samples else None

    @property
    def version(self) -> int | None:
        """The weight version this step was trained into (k+1), once it was."""
        version = self.number("train", "version")
        return int(version) if version is not None else (self.step + 1 if self.trained else None)


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[StepRecord], Any]
    fmt: str
    priority: int
    """0 is always shown; on a narrow terminal the highest number is dropped first."""


ROLLOUT_ROW_WAIT_S = 3.0
"""How long `StepFeed` holds a trained step back waiting for its rollout row (then prints it without)."""
EXACT = "agent/exact_correct"
"""The agent metric a task's headline is (the demo's: the reply is exactly right), shown when agents report it."""

COLUMNS = (
    Column("step", lambda r: r.step, "d", 0),
    Column("reward", lambda r: r.reward, ".3f", 1),
    Column("exact", lambda r: r.number("rollout", EXACT), ".3f", 1),
    Column("reward std", lambda r: r.number("rollout", "reward_std"), ".3f", 6),
    Column("length", lambda r: r.number("rollout", "sample_len_mean"), ".1f", 3),
    Column("sampled", lambda r: r.sampled_per_sample, ".1f", 7),
    Column("train tok/s", lambda r: r.number("train", "tokens_per_s"), ",.0f", 5),
    Column("staleness", lambda r: r.number("train", "staleness_mean"), ".2f", 8),
    Column("loss", lambda r: r.number("train", "loss"), ".4f", 4),
    Column("version", lambda r: r.version, "d", 2),
)
"""`length`: tokens per sample (prompt and completion); `sampled`: completion tokens per sample;
`staleness`: step minus the weight version each sample's oldest token came from, averaged;
`exact`: the share of runs whose agent reported `exact_correct` (the demo's agents do); `version`: the weight
version the step was trained into."""


def cell(column: Column, record: StepRecord) -> str:
    value = column.value(record)
    if value is None:
        return "-"
    return format(int(value) if column.fmt == "d" else float(value), column.fmt)


def step_line(record: StepRecord) -> str:
    """One plain line for a trained step, e.g.
    `step 3: reward 0.212 (std 0.101)  length 41.2 tokens (5.1 sampled)  train 1,234 tokens/s  staleness 0.50
    loss -0.0123  -> weight version 4`."""
    parts = []
    reward, std = record.reward, record.number("rollout", "reward_std")
    if reward is not None:
        parts.append(f"reward {reward:.3f}" + (f" (std {std:.3f})" if std is not None else ""))
    if (exact := record.number("rollout", EXACT)) is not None:
        parts.append(f"exact-correct {exact:.3f}")
    length, sampled = record.number("rollout", "sample_len_mean"), record.sampled_per_sample
    if length is not None:
        parts.append(f"length {length:.1f} tokens" + (f" ({sampled:.1f} sampled)" if sampled is not None else ""))
    tasks = record.task_rewards()
    if tasks:
        parts.append("tasks " + " · ".join(f"{name} {value:.3f}" for name, value in tasks.items()))
    if (speed := record.number("train", "tokens_per_s")) is not None:
        parts.append(f"train {speed:,.0f} tokens/s")
    if (stale := record.number("train", "staleness_mean")) is not None:
        parts.append(f"staleness {stale:.2f}")
    if (loss := record.number("train", "loss")) is not None:
        parts.append(f"loss {loss:.4f}")
    if record.version is not None:
        parts.append(f"-> weight version {record.version}")
    return f"step {record.step}: " + "  ".join(parts)


def step_table(records: list[StepRecord], console: Console) -> Table:
    """The steps as a table as wide as `console` allows, dropping the least important columns
    (and columns without a value) rather than cutting headers."""
    shown = [c for c in COLUMNS if c.priority == 0 or any(c.value(r) is not None for r in records)]

    def build(columns: list[Column]) -> Table:
        table = Table()
        for column in columns:
            table.add_column(column.header, justify="right", no_wrap=True)
        for record in records:
            table.add_row(*(cell(c, record) for c in columns))
        return table

    kept = fit_columns(shown, lambda cs: table_width(console, build(list(cs))), console.width, lambda c: c.priority)
    return build(kept)


def records_of(paths: RunPaths) -> list[StepRecord]:
    """Every step with a metrics row, in step order (read whole: for one-off views like `arl status`)."""
    rollout = {int(r["step"]): r for r in read_jsonl(paths.rollout_metrics)}
    train = {int(r["step"]): r for r in read_jsonl(paths.train_metrics)}
    return [StepRecord(s, rollout.get(s, {}), train.get(s, {})) for s in sorted(rollout.keys() | train.keys())]


class StepFeed:
    """Follows a run's two metrics files; `poll()` returns the steps trained since the last poll.

    `from_now`: steps already trained when the feed starts (a resumed run) are not handed out."""

    def __init__(self, paths: RunPaths, *, from_now: bool = False) -> None:
        self.rollout_tail = JsonlTail(paths.rollout_metrics)
        self.train_tail = JsonlTail(paths.train_metrics)
        self.rollout: dict[int, dict[str, Any]] = {}
        self.train: dict[int, dict[str, Any]] = {}
        self.handed_out: set[int] = set()
        self.waiting: dict[int, float] = {}
        """Trained steps held back until their rollout row is read: when each was first seen (monotonic)."""
        if from_now:
            self.poll()
            self.handed_out.update(self.train)
            self.waiting.clear()

    def poll(self, *, final: bool = False) -> list[StepRecord]:
        """The steps trained since the last poll, each with its rollout row; `final` (the run has ended): also
        those still waiting for it."""
        # The train file first: a step's rollout row is normally written before its train row, so reading the
        # rollout file after the train file finds it (the other order could hand out a step without its reward).
        # The rollout logs its row just after publishing the step's shards, so a fast trainer can still log first:
        # such a step waits for its rollout row, a few seconds at most.
        for row in self.train_tail.read_new():
            self.train[int(row["step"])] = row
        for row in self.rollout_tail.read_new():
            self.rollout[int(row["step"])] = row
        now = time.monotonic()
        new = []
        for step in sorted(set(self.train) - self.handed_out):
            first_seen = self.waiting.setdefault(step, now)
            if final or step in self.rollout or now - first_seen >= ROLLOUT_ROW_WAIT_S:
                new.append(step)
                self.waiting.pop(step)
            else:
                break  # in step order: a later step is not printed before an earlier one
        self.handed_out.update(new)
        return [StepRecord(s, self.rollout.get(s, {}), self.train[s]) for s in new]

    def records(self) -> list[StepRecord]:
        """Every step seen so far (trained or only rolled out), in step order."""
        steps = sorted(self.rollout.keys() | self.train.keys())
        return [StepRecord(s, self.rollout.get(s, {}), self.train.get(s, {})) for s in steps]


class JsonlTail:
    """The complete lines appended to a JSONL file since the last call (a line cut by `kill -9` is skipped,
    as `read_jsonl` does)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
        return rows
