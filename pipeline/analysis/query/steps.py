"""The table behind `arl query`'s `steps` view: one row per (run, step) of the run's metrics files.

Columns: `run`, `step`, then every key of `metrics/rollout.jsonl` as `rollout_<key>`, of `train.jsonl`
as `train_<key>`, and of each evaluation in `eval.jsonl` as `eval_<set>_<figure>` on the row whose `step`
is the evaluated weight version (the version rollout step k samples from when on-policy; the last version,
`num_steps`, gets a row of its own). Keys become plain SQL identifiers (`agent/exact_correct` ->
`rollout_agent_exact_correct`, `pass@1` -> `pass_1`) so no query needs quotes. The files are read the way
`arl status` reads them (`pipeline.run.sinks.read_jsonl`: a line cut by `kill -9` is skipped, a re-run
step's later line wins).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.eval.results import latest_evaluations
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl

_NOT_IDENTIFIER = re.compile(r"[^0-9a-z_]+")
_KEY_COLUMNS = ("step", "time")
"""Left out of the eval columns: `step` is the row's key, and each set's line has its own `time`."""

Cells = dict[tuple[str, str], Any]
"""(source, key) -> value: one step's metrics, source `rollout`, `train` or `eval_<set>`."""


@dataclass
class StepsData:
    """The `steps` rows, ready for DuckDB: column names with their SQL types, and one JSON object per row."""

    columns: list[tuple[str, str]]
    rows: list[dict[str, Any]]


def steps_data(runs: Sequence[tuple[str, RunPaths]]) -> StepsData:
    """The joined metrics of `runs` (label, paths), rows ordered by run (as given) then step."""
    cells: dict[tuple[int, int], Cells] = {}
    for index, (_, paths) in enumerate(runs):
        for source, step, record in _records(paths):
            cells.setdefault((index, step), {}).update({(source, k): v for k, v in record.items()})
    keys = sorted({key for row in cells.values() for key in row}, key=_source_order)
    order = sorted(cells)
    names = column_names(keys, taken={"run", "step"})
    columns = [("run", "VARCHAR"), ("step", "BIGINT")]
    rows: list[dict[str, Any]] = [{"run": runs[index][0], "step": step} for index, step in order]
    for name, key in zip(names, keys, strict=True):
        kind, values = typed_values([cells[at].get(key) for at in order])
        columns.append((name, kind))
        for row, value in zip(rows, values, strict=True):
            row[name] = value
    return StepsData(columns, rows)


def _records(paths: RunPaths) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(source, step, values) of every metrics line of the run that names a step."""
    for source, path in (("rollout", paths.rollout_metrics), ("train", paths.train_metrics)):
        for record in read_jsonl(path):
            step = int(record.get("step", -1))
            if step >= 0:
                yield source, step, {k: v for k, v in record.items() if k != "step"}
    for record in latest_evaluations(paths):
        values = {k: v for k, v in record.items() if k not in ("version", "set", *_KEY_COLUMNS)}
        yield f"eval_{record['set']}", int(record["version"]), values


def _source_order(key: tuple[str, str]) -> tuple[int, str, str]:
    source, name = key
    return ({"rollout": 0, "train": 1}.get(source, 2), source, name)


def column_names(keys: Sequence[tuple[str, str]], *, taken: set[str]) -> list[str]:
    """`<source>_<key>` as a lower-case SQL identifier; a name two keys share gets `_2`, `_3`, ... (in key order)."""
    names = []
    for source, key in keys:
        base = _NOT_IDENTIFIER.sub("_", f"{source}_{key}".lower()).strip("_")
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        names.append(name)
    return names


def typed_values(values: list[Any]) -> tuple[str, list[Any]]:
    """A column of JSON values as the narrowest SQL type (BOOLEAN, BIGINT, DOUBLE or VARCHAR) and its values;
    anything else (a dict such as `staleness_hist`, a list, mixed kinds) as JSON text, which DuckDB's `->>`
    reads."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return "BOOLEAN", values
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "BIGINT", values
    if present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return "DOUBLE", values
    if all(isinstance(v, str) for v in present):
        return "VARCHAR", values
    return "VARCHAR", [None if v is None else json.dumps(v, sort_keys=True) for v in values]
