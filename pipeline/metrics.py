"""Metrics sinks: one interface (`log(step, values)`, `close()`), JSONL and TensorBoard implementations,
and a null object so callers never branch on "is logging enabled"."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol


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

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in values.items()}}
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.path, "a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def close(self) -> None:
        return None


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


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
