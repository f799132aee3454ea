"""The DuckDB views `arl query` runs SQL against, over one or more run directories (docs/inspect.md).

`samples` reads the Parquet parts in place: DuckDB gets the exact list of part files of every complete
step, each checked against its manifest's sha256 first (`pipeline.run.shards.step_part_files`), so a step
being written, torn or corrupt never shows, and no row is copied through Python. `tokens` is computed
by DuckDB from the list columns of `samples` (one UNNEST per list, zipped by position). `steps` is the
one view built in Python: the metrics JSONL files are small, and their keys differ by run and by release.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from pipeline.analysis.query.steps import StepsData, steps_data
from pipeline.errors import ArlError, SchemaError
from pipeline.run.paths import RunPaths
from pipeline.run.shards import StepNotFound, step_part_files
from schemas.trajectory import SCHEMA

if TYPE_CHECKING:
    import duckdb

VIEWS = ("samples", "tokens", "steps")
"""The views every query sees, in the order `--schema` lists them."""


class QueryError(ArlError):
    """The runs or the SQL given to `arl query` cannot be used (the message says why, on one line)."""


@dataclass(frozen=True)
class Run:
    label: str
    """The value of the `run` column: the shortest trailing part of the path that tells the runs apart."""
    paths: RunPaths


@dataclass
class Catalog:
    """A DuckDB connection holding the views, and what went into them."""

    connection: duckdb.DuckDBPyConnection
    runs: list[Run]
    read_steps: dict[str, list[int]] = field(default_factory=dict)
    """The trajectory steps in `samples`, per run label."""
    notes: list[str] = field(default_factory=list)
    """One line per complete-looking step left out (bad checksum, missing part, unreadable manifest)."""


def connect(run_dirs: Sequence[str | Path], *, verify: bool = True, progress: bool = False) -> Catalog:
    """An in-memory DuckDB connection with the views `samples`, `tokens` and `steps` over `run_dirs`.

    `verify=False` trusts the manifests' part lists without hashing the parts (faster on runs of many GB;
    a step without a manifest is still never read). `progress`: DuckDB's progress bar on queries past 2 s
    (it prints to stdout, so only where stdout is a person's terminal).
    """
    import duckdb

    runs = resolve_runs(run_dirs)
    files, steps, notes = _complete_parts(runs, verify=verify)
    con = duckdb.connect(":memory:")
    # Timestamps print the same on every machine; the shards store UTC.
    con.execute("SET TimeZone = 'UTC'")
    con.execute(f"SET enable_progress_bar = {str(progress).lower()}")
    con.execute(f"CREATE VIEW samples AS {samples_sql(files)}")
    con.execute(f"CREATE VIEW tokens AS {TOKENS_SQL}")
    _load_steps(con, steps_data([(run.label, run.paths) for run in runs]))
    return Catalog(con, runs, steps, notes)


# -- runs ---------------------------------------------------------------------------------------
def resolve_runs(run_dirs: Sequence[str | Path]) -> list[Run]:
    """The run dirs, checked (each exists, is a run dir, and is given once) and labelled."""
    if not run_dirs:
        raise QueryError('no run dir given: arl query RUN_DIR [RUN_DIR ...] "SQL"')
    roots: list[Path] = []
    for given in map(Path, run_dirs):
        if not given.is_dir():
            raise QueryError(f"{given}: no such run dir" if not given.exists() else f"{given} is not a directory")
        paths = RunPaths(given)
        if not (paths.config.is_file() or paths.trajectories.is_dir()):
            raise QueryError(f"{given} is not a run dir: it holds neither config.yaml nor trajectories/")
        root = given.resolve()
        if root in roots:
            raise QueryError(f"run dir given twice: {given} is {root}, already given; give each run once")
        roots.append(root)
    return [Run(label, RunPaths(root)) for label, root in zip(run_labels(roots), roots, strict=True)]


def run_labels(roots: Sequence[Path]) -> list[str]:
    """`trial0` for one run; `a/trial0`, `b/trial0` for two trials of that name: the same depth for every run."""
    for depth in range(1, max(len(root.parts) for root in roots) + 1):
        labels = ["/".join(root.parts[-depth:]).lstrip("/") or "/" for root in roots]
        if len(set(labels)) == len(labels):
            return labels
    return [str(root) for root in roots]  # unreachable for distinct paths; kept total


def _complete_parts(runs: list[Run], *, verify: bool) -> tuple[dict[str, list[Path]], dict[str, list[int]], list[str]]:
    """Per run: the part files of its complete steps, the steps, and a note for every step left out."""
    jobs = [(run, step) for run in runs for step in run.paths.complete_steps()]

    def check(job: tuple[Run, int]) -> list[Path] | str:
        run, step = job
        try:
            return step_part_files(run.paths.step_dir(step), verify=verify, paths=run.paths)[1]
        except (SchemaError, StepNotFound) as exc:  # StepNotFound: re-written (renamed away) since listed
            return f"{run.label}: step {step} left out: {exc}"

    # Hashing releases the GIL: a few threads keep the disk and the cores busy on runs of many steps.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="arl-verify") as pool:
        outcomes = list(pool.map(check, jobs))
    files: dict[str, list[Path]] = {run.label: [] for run in runs}
    steps: dict[str, list[int]] = {run.label: [] for run in runs}
    notes = []
    for (run, step), outcome in zip(jobs, outcomes, strict=True):
        if isinstance(outcome, str):
            notes.append(outcome)
        else:
            files[run.label].extend(outcome)
            steps[run.label].append(step)
    return files, steps, notes


# -- views --------------------------------------------------------------------------------------
def samples_sql(files: dict[str, list[Path]]) -> str:
    """One SELECT per run with parts, UNION ALL'd; the empty shard schema when no run has any."""
    selects = [
        # hive_partitioning off: a run dir path holding `key=value` must not grow a column
        f"SELECT {_literal(label)} AS run, *, {_DERIVED} "
        f"FROM read_parquet([{', '.join(_literal(str(p)) for p in parts)}], hive_partitioning = false)"
        for label, parts in files.items()
        if parts
    ]
    return "\nUNION ALL\n".join(selects) or f"SELECT NULL::VARCHAR AS run, *, {_DERIVED} FROM ({_empty_shards_sql()})"


# `len(loss_mask)`, not `len(input_ids)`: the same length (schema invariant 1), and the mask is a run-length
# encoded int8 column that decodes in under half the time, which a query using `n_sampled` reads anyway.
_DERIVED = "len(loss_mask) AS n_tokens, CAST(list_sum(loss_mask) AS BIGINT) AS n_sampled"

TOKENS_SQL = """
SELECT run, step, sample_id,
       UNNEST(range(n_tokens)) AS pos,
       UNNEST(input_ids) AS token_id,
       UNNEST(loss_mask) AS loss_mask,
       UNNEST(logprobs) AS logprob,
       UNNEST(versions) AS version
FROM samples
"""
"""Several UNNESTs in one SELECT are zipped element by element (every list column has the same length)."""


def _load_steps(con: duckdb.DuckDBPyConnection, data: StepsData) -> None:
    """The `steps` table, through a temporary JSON-lines file DuckDB reads with the columns' types. Not through
    Arrow: DuckDB's Arrow paths and pyarrow's Parquet writer import pandas, most of a second on every query."""
    with tempfile.TemporaryDirectory(prefix="arl-query-") as tmp:
        path = Path(tmp) / "steps.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in data.rows))
        types = ", ".join(f"{_literal(name)}: {_literal(kind)}" for name, kind in data.columns)
        con.execute(
            f"CREATE TABLE steps AS SELECT * FROM read_json({_literal(str(path))}, "
            f"format = 'newline_delimited', columns = {{{types}}})"
        )


def _empty_shards_sql() -> str:
    """The shard columns with no row (for runs without a complete step), typed as DuckDB types Parquet parts."""
    return "SELECT " + ", ".join(f"CAST(NULL AS {_sql_type(f.type)}) AS {f.name}" for f in SCHEMA) + " WHERE false"


def _sql_type(kind: pa.DataType) -> str:
    if pa.types.is_list(kind):
        return _sql_type(kind.value_type) + "[]"
    if pa.types.is_timestamp(kind):
        return "TIMESTAMPTZ" if kind.tz else "TIMESTAMP"
    return _SQL_TYPES[str(kind)]


_SQL_TYPES = {
    "int8": "TINYINT",
    "int32": "INTEGER",
    "int64": "BIGINT",
    "float": "FLOAT",
    "double": "DOUBLE",
    "string": "VARCHAR",
    "bool": "BOOLEAN",
}


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
