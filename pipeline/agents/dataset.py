"""Prompt data and the deterministic step schedule that makes resume exact.

Datasets: a JSONL file (one JSON object per line), a Parquet file, or a directory written by
`datasets`' `save_to_disk` (a `DatasetDict` needs `rollout.dataset.split`). Rows are dicts.

Schedule (the reason resume is exact by construction): concatenate epochs 0, 1, 2, ... of the
dataset, each in its own order (a permutation seeded by `(seed, epoch)` when `shuffle`, else file
order). Step k uses the global positions `[k * batch_size, (k + 1) * batch_size)` of that sequence.
So the prompts of step k depend only on k and the config: the same whether the run went straight
through, was resumed after `kill -9`, or step k is redone with `--step k`. The cursor file
`state/rollout_cursor.json` is therefore a *record* (what was last published, and the dataset
fingerprint it was computed from), checked on resume so that a dataset changed under a running
experiment is an error rather than a silently different schedule.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline.errors import ArlError
from pipeline.run.handoff import read_json, write_json_atomic
from schemas.config import DatasetConfig
from schemas.config.rollout import DEFAULT_TASK


class DataError(ArlError):
    """The dataset cannot be read, is empty, or changed under a running experiment."""


class Rows(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


class _ParquetRows:
    """Random access into a Parquet table (kept columnar; one row converted per access)."""

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        self.table = pq.read_table(path)

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.table.slice(index, 1).to_pylist()[0])


class _HFRows:
    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.dataset[int(index)])


def load_rows(config: DatasetConfig) -> Rows:
    """Open the dataset the config names; errors say which file and what is wrong."""
    path = Path(config.path)
    if not path.exists():
        raise DataError(f"dataset {path} does not exist (relative paths start at {Path.cwd()})")
    if path.is_dir():
        rows: Rows = _load_saved_dataset(path, config.split)
    elif path.suffix in (".parquet", ".pq"):
        rows = _ParquetRows(path)
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        rows = _load_jsonl(path)
    else:
        raise DataError(
            f"dataset {path}: unknown format {path.suffix!r}; use .jsonl, .parquet, "
            "or a directory written by datasets' save_to_disk"
        )
    if len(rows) == 0:
        raise DataError(f"dataset {path} holds no rows")
    return rows


def _load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in numbered_jsonl(path)]


def numbered_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """A JSONL file's objects with their line numbers (blank lines skipped); a line that is not a JSON object is a
    `DataError` naming the file and line."""
    rows: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number} is not valid JSON: {exc}") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number} holds a {type(row).__name__}; every line must be a JSON object")
        rows.append((number, row))
    return rows


def _load_saved_dataset(path: Path, split: str | None) -> Rows:
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError as exc:
        raise DataError(f"{path} is a directory: reading a save_to_disk dataset needs `pip install datasets`") from exc
    loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        if split is None:
            raise DataError(f"{path} is a DatasetDict with splits {list(loaded)}: set the dataset's split")
        if split not in loaded:
            raise DataError(f"{path} has no split {split!r}; it has {list(loaded)}")
        loaded = loaded[split]
    elif split is not None and not isinstance(loaded, Dataset):
        raise DataError(f"{path}: split={split!r} given but it is not a DatasetDict")
    return _HFRows(loaded)


@dataclass(frozen=True)
class Prompt:
    """One scheduled prompt: where it sits in the global sequence and in the dataset."""

    position: int
    """Global position in the epoch-concatenated order (step k holds [k*B, (k+1)*B))."""
    epoch: int
    index: int
    """Row index in the dataset."""
    data: dict[str, Any]
    task: str = DEFAULT_TASK
    """The task it belongs to (`rollout.tasks`; `default` for the one-task shorthand)."""


class Schedule:
    """Which prompts each step uses (see the module docstring)."""

    def __init__(self, rows: Rows, batch_size: int, *, shuffle: bool, seed: int) -> None:
        self.rows = rows
        self.size = len(rows)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> Sequence[int]:
        if not self.shuffle:
            return range(self.size)
        if epoch not in self._orders:
            order = list(range(self.size))
            random.Random(f"arl-rollout:{self.seed}:{epoch}").shuffle(order)  # str seeds hash stably
            self._orders = {epoch: order}  # only the current epoch is needed; steps go forward
        return self._orders[epoch]

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, dataset index) of a global position."""
        epoch, offset = divmod(position, self.size)
        return epoch, self.order(epoch)[offset]

    def prompts(self, step: int) -> list[Prompt]:
        first = step * self.batch_size
        out = []
        for position in range(first, first + self.batch_size):
            epoch, index = self.locate(position)
            out.append(Prompt(position=position, epoch=epoch, index=index, data=self.rows[index]))
        return out

    def fingerprint(self) -> dict[str, Any]:
        return {"dataset_len": self.size, "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed}

    def cursor(self, step: int) -> dict[str, Any]:
        """Where the step after `step` starts (the cursor file's record)."""
        next_position = (step + 1) * self.batch_size
        epoch, offset = divmod(next_position, self.size)
        return {"next_position": next_position, "epoch": epoch, "offset_in_epoch": offset}


class PromptSource(Protocol):
    """A step's prompts as a pure function of the step (`Schedule`, or `pipeline.rollout.tasks.TaskMix`)."""

    def prompts(self, step: int) -> list[Prompt]: ...
    def fingerprint(self) -> dict[str, Any]: ...
    def cursor(self, step: int) -> dict[str, Any]: ...


def write_cursor(path: Path, schedule: PromptSource, step: int, dataset_path: str) -> None:
    """Record that `step` is published and where the next step starts (atomic).

    Redoing an earlier step (`--step N`) leaves a record of a later step in place.
    """
    if path.exists() and int(read_json(path).get("last_step", -1)) > step:
        return
    write_json_atomic(
        path,
        {
            "last_step": step,
            "next_step": step + 1,
            **schedule.cursor(step),
            "dataset_path": dataset_path,
            **schedule.fingerprint(),
        },
    )


def check_cursor(path: Path, schedule: PromptSource) -> dict[str, Any] | None:
    """Refuse to resume when the schedule the cursor was written with differs from today's."""
    if not path.exists():
        return None
    record = read_json(path)
    now = schedule.fingerprint()
    changed = {k: (record.get(k), v) for k, v in now.items() if k in record and record[k] != v}
    if changed:
        details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise DataError(
            f"{path} was written with a different prompt schedule ({details}); resuming would use other "
            "prompts than the steps already published. Restore the dataset/config, or start a new trial_name"
        )
    return dict(record)
