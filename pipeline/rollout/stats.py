"""Per-step rollout statistics: what goes into `metrics/rollout.jsonl` and the manifest's `extra`.

One `StepTally` collects the runs of a step as they finish; `summary()` turns it into a flat dict of
numbers (plus the staleness histogram) that both the metrics sinks and `arl status` read.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.rollout.staleness import staleness_histogram
from schemas.trajectory import TrajectoryRow


@dataclass
class StepTally:
    step: int
    started: float = field(default_factory=time.monotonic)
    runs: int = 0
    finished: int = 0
    rejected: int = 0
    empty: int = 0
    """Runs that returned a reward but made no LLM call (nothing to train on)."""
    agent_errors: int = 0
    timeouts: int = 0
    turns: list[int] = field(default_factory=list)
    prefix_breaks: int = 0
    dropped_stale: int = 0
    dropped_constant_groups: int = 0
    dropped_constant_samples: int = 0
    last_traceback: str | None = None
    weight_version: int = 0
    first_calls: list[float] = field(default_factory=list)
    """Per run: seconds from its session's start to its first LLM call (the agent's start-up)."""
    times: dict[str, float] = field(default_factory=dict)
    """The step's timeline so far (`time_*_s`: waiting for weights, the runs), set by the rollout loop."""
    no_call: int = 0
    """Finished runs that made no LLM call the proxy recorded (rejected ones included)."""
    no_call_refusal: str | None = None
    """The last error the proxy answered such a run's call with: the exception its agent may have swallowed."""
    agent_metrics: dict[str, list[float]] = field(default_factory=dict)
    """Per-run metrics the agents returned (`(reward, {name: value})`), by name, of the runs not rejected."""

    def add_error(self, traceback_text: str, *, timed_out: bool) -> None:
        self.runs += 1
        self.agent_errors += 1
        self.timeouts += int(timed_out)
        self.last_traceback = traceback_text

    def add_finished(
        self,
        *,
        rejected: bool,
        num_interactions: int,
        prefix_breaks: int,
        samples: int,
        metrics: dict[str, float] | None = None,
        first_call_s: float | None = None,
        refusal: str | None = None,
    ) -> None:
        self.runs += 1
        if num_interactions == 0:
            self.no_call += 1
            self.no_call_refusal = refusal or self.no_call_refusal
        if first_call_s is not None:
            self.first_calls.append(first_call_s)
        self.finished += 1
        self.prefix_breaks += prefix_breaks
        if rejected:
            self.rejected += 1
        elif samples == 0:
            self.empty += 1
        else:
            self.turns.append(num_interactions)
        if not rejected:
            for name, value in (metrics or {}).items():
                self.agent_metrics.setdefault(name, []).append(value)

    @property
    def error_rate(self) -> float:
        return self.agent_errors / self.runs if self.runs else 0.0

    def summary(self, rows: list[TrajectoryRow]) -> dict[str, Any]:
        """Numbers for the metrics line; `rows` are the samples that will be published."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rewards = [float(r.reward) for r in rows]
        tokens = sum(len(r.input_ids) for r in rows)
        sampled = sum(sum(r.loss_mask) for r in rows)
        return {
            "reward_mean": _mean(rewards),
            "reward_std": _std(rewards),
            "reward_min": min(rewards) if rewards else None,
            "reward_max": max(rewards) if rewards else None,
            "samples": len(rows),
            "groups": len({r.group_id for r in rows}),
            "sessions": len({r.session_id for r in rows}),
            "tokens": tokens,
            "sampled_tokens": sampled,
            "sample_len_mean": tokens / len(rows) if rows else None,
            "turns_mean": _mean([float(t) for t in self.turns]),
            "runs": self.runs,
            "rejected": self.rejected,
            "empty_runs": self.empty,
            "agent_errors": self.agent_errors,
            "timeouts": self.timeouts,
            "error_rate": self.error_rate,
            "prefix_breaks": self.prefix_breaks,
            "dropped_stale": self.dropped_stale,
            "dropped_constant_groups": self.dropped_constant_groups,
            "dropped_constant_samples": self.dropped_constant_samples,
            "runs_per_s": self.runs / elapsed,
            "duration_s": elapsed,
            "weight_version": self.weight_version,
            "staleness_hist": staleness_histogram(rows, self.step),
            "time_agent_start_s": _mean(self.first_calls),
            **self.times,
            **{f"agent/{name}": _mean(values) for name, values in sorted(self.agent_metrics.items())},
        }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _std(values: list[float]) -> float | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def drop_constant_groups(rows: list[TrajectoryRow], tol: float = 1e-8) -> tuple[list[TrajectoryRow], int, int]:
    """Remove groups whose rewards do not vary (no GRPO signal): (kept rows, groups dropped, rows dropped)."""
    by_group: dict[str, list[float]] = {}
    for row in rows:
        by_group.setdefault(row.group_id, []).append(float(row.reward))
    constant = {g for g, rs in by_group.items() if max(rs) - min(rs) <= tol}
    kept = [r for r in rows if r.group_id not in constant]
    return kept, len(constant), len(rows) - len(kept)
