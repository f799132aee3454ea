"""A step's timeline: where the wall time of a step went, stage by stage, from its two metrics rows.

Each stage measures its own intervals and writes them in its metrics row (`time_*_s`), so the figures
are in every run's `metrics/*.jsonl` (and TensorBoard, W&B), and `arl status` prints them for the
newest trained step. The rollout and the trainer run at the same time (with `max_staleness >= 1` the
next step is sampled while this one trains), so each stage's intervals add up to that stage's step time,
not to each other. What the intervals do not cover is listed as `other` (Python between the measured
parts: planning, metrics, logging). Each stage's line ends with the CPU seconds its process used over the
step (`cpu_s`): close to the step's wall time means the stage is CPU-bound (the rollout's figure includes the
in-process proxy and inline agents).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.run.progress import StepRecord


@dataclass(frozen=True)
class Interval:
    source: str
    """Which metrics row holds it: `rollout` or `train`."""
    key: str
    label: str
    part_of: str | None = None
    """The interval this one is a part of (not added again to the stage's sum)."""


ROLLOUT = (
    Interval("rollout", "time_wait_weights_s", "wait for weights"),
    Interval("rollout", "time_runs_s", "agent runs"),
    Interval("rollout", "time_agent_start_s", "agent start-up, mean", part_of="time_runs_s"),
    Interval("rollout", "time_write_s", "shard write + publish"),
)
TRAIN = (
    Interval("train", "time_wait_s", "wait for the shard"),
    Interval("train", "time_load_s", "load shard"),
    Interval("train", "time_compute_s", "training"),
    Interval("train", "time_checkpoint_s", "checkpoint write"),
    Interval("train", "time_eval_hold_s", "hold for the in-run evaluation"),
    Interval("train", "time_publish_s", "publication"),
    Interval("train", "weight_sync_s", "server reload", part_of="time_publish_s"),
    Interval("train", "verify_s", "verification", part_of="time_publish_s"),
)


def stage_timeline(record: StepRecord, intervals: tuple[Interval, ...]) -> list[tuple[str, float, bool]]:
    """(label, seconds, is a part of another) for every interval the row has, then `other` and the step's wall
    time; [] when the row has no step time (a run from before timelines, or a row not written yet)."""
    source = intervals[0].source
    total = record.number(source, "time_step_s")
    if total is None:
        return []
    out: list[tuple[str, float, bool]] = []
    covered = 0.0
    for interval in intervals:
        value = record.number(source, interval.key)
        if value is None:
            continue
        out.append((interval.label, value, interval.part_of is not None))
        covered += 0.0 if interval.part_of else value
    out.append(("other", max(total - covered, 0.0), False))
    out.append(("step", total, False))
    return out


def timeline_lines(record: StepRecord) -> list[str]:
    """The step's timeline for people: one line per stage, an interval's parts in parentheses after it."""
    lines = []
    for name, intervals in (("rollout", ROLLOUT), ("trainer", TRAIN)):
        items = stage_timeline(record, intervals)
        words: list[str] = []
        parts: list[str] = []
        for label, seconds, part in items:
            if part:
                parts.append(f"{label} {seconds:.2f}")
                continue
            if parts:
                words[-1] += f" ({', '.join(parts)})"
                parts = []
            words.append(f"{label} {seconds:.2f}")
        cpu = record.number(intervals[0].source, "cpu_s")
        if words and cpu is not None:  # CPU beside wall time: a stage near 1.0 s per second is CPU-bound
            words.append(f"CPU {cpu:.2f}")
        if words:
            lines.append(f"  {name:<8} " + " · ".join(words))
    return lines
