"""Metrics sinks: one interface (`log(step, values)`, `close()`), JSONL, TensorBoard and W&B implementations,
and a null object so callers never branch on "is logging enabled"."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.errors import ArlError
from pipeline.run.handoff import write_text_atomic

if TYPE_CHECKING:
    from pipeline.run.paths import RunPaths
    from schemas.config import ArlConfig


class MetricsSink(Protocol):
    def log(self, step: int, values: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    def log(self, step: int, values: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


class JsonlSink:
    """Appends one JSON object per step; each line is written with one `write` + fsync so a
    reader (`arl status`) never sees half a line, and a crash loses at most the line in flight."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        drop_torn_tail(path)

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in values.items()}}
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.path, "a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def close(self) -> None:
        return None


def drop_torn_tail(path: Path) -> None:
    """Cut a last line that has no newline: a writer killed inside its `write` (one writer per file).

    Appending after such a fragment would glue the next line onto it and lose both; the fragment alone
    cannot be read anyway, and its row is logged again by whoever owns it (the trainer's held row,
    `pipeline/trainer/step_row.py`)."""
    try:
        with open(path, "rb+") as handle:
            if handle.seek(0, os.SEEK_END) == 0 or (handle.seek(-1, os.SEEK_END) and handle.read(1) == b"\n"):
                return  # the usual case: read one byte, not the file
            handle.seek(0)
            data = handle.read()
            keep = data.rfind(b"\n") + 1
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
    except FileNotFoundError:
        return
    logging.getLogger("arl.metrics").warning(
        "%s ended in a line cut mid-write (%d bytes): dropped it before appending", path, len(data) - keep
    )


class TensorBoardSink:
    """Scalars only (non-numeric values are skipped); imported lazily because tensorboard is slow to import."""

    def __init__(self, logdir: Path, prefix: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))
        self.prefix = prefix

    def log(self, step: int, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            self.writer.add_scalar(f"{self.prefix}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One stage's W&B run (`open_wandb`): numbers under `<prefix>/` at W&B step = the JSONL row's `step`;
    a dict of numbers (`staleness_hist`) becomes one series per key. None and non-finite values are left out."""

    def __init__(self, run: Any, prefix: str) -> None:
        self.run = run
        self.prefix = prefix

    def log(self, step: int, values: dict[str, Any]) -> None:
        row = dict(_numbers(values, self.prefix))
        if row:
            self.run.log(row, step=step)

    def close(self) -> None:
        # Stages close their sinks in a `finally`: an exception on its way out marks the W&B run failed.
        self.run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)


def open_wandb(
    config: ArlConfig, paths: RunPaths, stage: str, *, prefix: str, redo_step: int | None = None
) -> MetricsSink:
    """`stage`'s W&B run, or a null sink when `metrics.wandb` is unset (wandb is then never imported).

    One W&B run per stage process, all of a trial's in one group: each stage writes its own rows from
    its own process and W&B runs have one writer. The run id is kept in the run dir, so a stage started
    again (`arl launch --resume`, a requeue) continues the same W&B run; `--step N` (`redo_step`) gets
    a run of its own, because W&B ignores a step below one it already holds.
    """
    cfg = config.metrics.wandb
    if cfg is None:
        return NullSink()
    wandb = import_wandb()
    trial = f"{config.experiment_name}/{config.trial_name}"
    name = f"{trial}/{stage}" if redo_step is None else f"{trial}/{stage}-redo-step{redo_step}"
    try:
        run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            group=cfg.group or trial,
            job_type=stage,
            name=name,
            tags=cfg.tags,
            notes=f"arl run dir {paths.root}",
            config=config.model_dump(mode="json"),
            id=wandb_run_id(paths, stage, redo_step),
            resume="allow",
            dir=str(paths.metrics),
            reinit="create_new",
            settings=wandb.Settings(console="off"),  # the stage's output already goes to logs/<stage>/
        )
    except wandb.errors.Error as exc:
        raise ArlError(
            f"metrics.wandb: W&B could not start the {stage} stage's run ({exc}); on this node set "
            "WANDB_API_KEY (or run `wandb login`), or use metrics.wandb.mode=offline and "
            f"`wandb sync {paths.wandb}/offline-run-*` later"
        ) from exc
    return WandbSink(run, prefix)


def import_wandb() -> Any:
    """The wandb module, or the one-line error naming the extra that installs it."""
    try:
        import wandb
    except ImportError as exc:
        raise ArlError(
            "metrics.wandb is set but wandb is not installed here: pip install 'arl[wandb]' "
            "(or drop metrics.wandb from the config)"
        ) from exc
    return wandb


def wandb_run_id(paths: RunPaths, stage: str, redo_step: int | None) -> str:
    """The stage's W&B run id: read from the run dir, or made and written there on its first start."""
    if redo_step is not None:
        return f"{stage}-step{redo_step}-{secrets.token_hex(4)}"
    path = paths.wandb_run_id(stage)
    if path.exists():
        return path.read_text().strip()
    run_id = f"{stage}-{secrets.token_hex(4)}"
    write_text_atomic(path, run_id + "\n")
    return run_id


class MultiSink:
    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def log(self, step: int, values: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete records of a metrics file, later lines for the same step winning (reruns)."""
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by kill -9
        by_step[int(record.get("step", -1))] = record
    return [by_step[k] for k in sorted(by_step)]


def _numbers(values: dict[str, Any], prefix: str) -> Iterator[tuple[str, float]]:
    """`prefix/key` and finite number for each numeric value; `prefix/key/sub` for a dict of numbers."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _numbers(value, f"{prefix}/{key}")
            continue
        value = _jsonable(value)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            yield f"{prefix}/{key}", value


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
