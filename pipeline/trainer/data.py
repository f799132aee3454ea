"""Load one complete step of trajectory shards into `Sample`s, validated and staleness-checked.

Staleness policy (documented in docs/trainer.md): a sample whose oldest sampled token came from
weight version < max(k - max_staleness, 0) (`pipeline.run.weight_version.oldest_usable_version`, the
rollout's bound too) is DROPPED and counted (`stale_dropped` metric, a warning in the
log), not an error: the rollout admits sessions under the bound, but a long multi-turn session
admitted in time can still straddle it, and one such sample must not stop a cluster run. If every
sample of the step is dropped the step is an error (there is nothing to train on, and it means
the rollout ignores the bound). Samples with no trainable token (only position 0 sampled) are
dropped and counted the same way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np

from pipeline.errors import SchemaError
from pipeline.run.paths import RunPaths
from pipeline.run.weight_version import oldest_usable_version
from schemas.config.rollout import DEFAULT_TASK, task_of

log = logging.getLogger("arl.trainer")

COLUMNS = ["step", "sample_id", "group_id", "input_ids", "loss_mask", "logprobs", "versions", "reward"]


@dataclass
class Sample:
    """One training row (a trajectory shard row reduced to what the trainer uses)."""

    sample_id: str
    group_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    task: str = DEFAULT_TASK
    """`metadata.task` (runs with `rollout.tasks`), read only where the trainer needs it."""

    @property
    def min_version(self) -> int:
        return int(self.versions[self.loss_mask == 1].min())

    @property
    def trained_tokens(self) -> int:
        """Sampled tokens that have a context (position >= 1): the tokens the loss sees."""
        return int(self.loss_mask[1:].sum())


@dataclass
class StepData:
    step: int
    samples: list[Sample]
    stale_dropped: int = 0
    untrainable_dropped: int = 0
    staleness: list[int] = field(default_factory=list)
    """k - min_version per kept sample."""


def rows_to_samples(rows: list[dict]) -> list[Sample]:
    """Turn shard rows (dicts with the trajectory columns) into Samples."""
    return [
        Sample(
            sample_id=str(r["sample_id"]),
            group_id=str(r["group_id"]),
            input_ids=np.asarray(r["input_ids"], dtype=np.int64),
            loss_mask=np.asarray(r["loss_mask"], dtype=np.int8),
            logprobs=np.asarray(r["logprobs"], dtype=np.float32),
            versions=np.asarray(r["versions"], dtype=np.int32),
            reward=float(r["reward"]),
            task=task_of(json.loads(r["metadata"])) if "metadata" in r else DEFAULT_TASK,
        )
        for r in rows
    ]


def load_step(paths: RunPaths, step: int, max_staleness: int, with_tasks: bool = False) -> StepData:
    """Read and check trajectories/step_k (schema version and sha256 are checked by `read_step`); `with_tasks`
    also reads each sample's task from its metadata."""
    from pipeline.run.shards import read_step

    table = read_step(paths, step, verify=True, columns=[*COLUMNS, "metadata"] if with_tasks else COLUMNS)
    rows = table.to_pylist()
    wrong = sorted({r["step"] for r in rows if r["step"] != step})
    if wrong:
        raise SchemaError(f"{paths.step_dir(step)} holds rows of steps {wrong}: the rollout mislabelled them")
    return filter_samples(step, rows_to_samples(rows), max_staleness, where=str(paths.step_dir(step)))


def filter_samples(step: int, samples: list[Sample], max_staleness: int, where: str = "step") -> StepData:
    """Drop (and count) samples older than the staleness bound or with nothing to train."""
    _check_invariants(samples, where)
    oldest_allowed = oldest_usable_version(step, max_staleness)
    kept, stale, untrainable = [], 0, 0
    for s in samples:
        if s.min_version < oldest_allowed:
            stale += 1
        elif s.trained_tokens == 0:
            untrainable += 1
        else:
            kept.append(s)
    if stale:
        log.warning(
            "step %d: dropped %d samples sampled with weights older than version %d (max_staleness=%d)",
            step,
            stale,
            oldest_allowed,
            max_staleness,
        )
    if samples and not kept:
        raise SchemaError(
            f"{where}: all {len(samples)} samples dropped ({stale} older than version {oldest_allowed}, the "
            f"bound of step {step} with max_staleness {max_staleness}; {untrainable} without trainable tokens); "
            "the rollout must respect rollout.max_staleness"
        )
    if not samples:
        raise SchemaError(f"{where}: the step has no samples; nothing to train on")
    return StepData(step, kept, stale, untrainable, [step - s.min_version for s in kept])


def _check_invariants(samples: list[Sample], where: str) -> None:
    """The few invariants the trainer relies on (the full docs/trajectory-schema.md check runs where shards
    are written)."""
    for s in samples:
        n = len(s.input_ids)
        if not (len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n) or n == 0:
            raise SchemaError(f"{where}: sample {s.sample_id!r} has list columns of different lengths")
        if not s.loss_mask.any():
            raise SchemaError(f"{where}: sample {s.sample_id!r} has no sampled token (loss_mask all 0)")
        if not np.isfinite(s.reward):
            raise SchemaError(f"{where}: sample {s.sample_id!r} has a non-finite reward {s.reward}")
        if not np.isfinite(s.logprobs).all():
            raise SchemaError(f"{where}: sample {s.sample_id!r} has non-finite behaviour log-probs")
