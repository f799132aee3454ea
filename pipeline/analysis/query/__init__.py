"""`arl query RUN_DIR [RUN_DIR ...] "SQL"`: SQL over runs' trajectory shards and metrics, on DuckDB.

The views (`samples`, `tokens`, `steps`) are built in `pipeline.analysis.query.catalog`; results are written by
`pipeline.analysis.query.output`. From Python, `connect([run_dir, ...]).connection.sql("...")` gives a DuckDB
relation (`.df()`, `.arrow()`, `.fetchall()`) over the same views. docs/inspect.md has the reference and
worked queries.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.analysis.query.catalog import VIEWS, Catalog, QueryError, connect
from pipeline.analysis.query.output import FORMATS, emit, one_line

__all__ = ["FORMATS", "VIEWS", "Catalog", "QueryError", "connect", "query_command"]

SCHEMA_SQL = f"""
SELECT table_name AS view, column_name AS column, data_type AS type
FROM information_schema.columns
WHERE table_name IN ({", ".join(f"'{v}'" for v in VIEWS)})
ORDER BY {" ".join(["CASE table_name", *(f"WHEN '{v}' THEN {i}" for i, v in enumerate(VIEWS)), "END"])},
         ordinal_position
"""
"""What `--schema` runs: every view's columns, in view order then column order."""


def query_command(
    args: Sequence[str],
    *,
    sql_file: Path | None = None,
    fmt: str = "table",
    output: Path | None = None,
    limit: int | None = None,
    schema: bool = False,
    verify: bool = True,
) -> int:
    """Run one query (or list the views with `schema`) over the run dirs in `args`; returns the exit code (0)."""
    import duckdb

    if fmt not in FORMATS:
        raise QueryError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if limit is not None and limit < 0:
        raise QueryError(f"--limit must be >= 0, got {limit}")
    run_dirs, sql = split_args(args, sql_file=sql_file, schema=schema)
    catalog = connect(run_dirs, verify=verify, progress=sys.stdout.isatty() and (fmt == "table" or output is not None))
    try:
        for note in catalog.notes:
            print(f"note: {note}", file=sys.stderr)
        try:
            relation = catalog.connection.sql(SCHEMA_SQL if schema else sql)
            if relation is not None:  # None: the SQL's last statement returns no rows (SET, CREATE VIEW, ...)
                emit(catalog.connection, relation, fmt=fmt, output=output, limit=limit)
        except duckdb.Error as exc:
            raise QueryError(f"query failed: {one_line(exc)}") from None
    finally:
        catalog.connection.close()
    return 0


def split_args(args: Sequence[str], *, sql_file: Path | None, schema: bool) -> tuple[list[str], str]:
    """The run dirs and the SQL: the last argument, or `--file`'s content (`-`: stdin); none with `--schema`."""
    if schema:
        return list(args), ""
    if sql_file is not None:
        return list(args), _nonempty(_read_sql(str(sql_file)), str(sql_file))
    if len(args) < 2:
        raise QueryError(
            'give one or more run dirs, then the SQL: arl query RUN_DIR [RUN_DIR ...] "SQL" '
            "(or --file FILE, or - to read it from stdin)"
        )
    *run_dirs, sql = args
    if os.path.isdir(sql):  # not Path.is_dir: a long SQL text is a name too long for stat, an OSError
        raise QueryError(
            f'the last argument must be the SQL, got the directory {sql}: arl query RUN_DIR [RUN_DIR ...] "SQL"'
        )
    return run_dirs, _nonempty(_read_sql(sql) if sql == "-" else sql, "the SQL argument")


def _read_sql(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).read_text()
    except OSError as exc:
        raise QueryError(f"--file {source}: cannot read: {exc.strerror or exc}") from None


def _nonempty(sql: str, source: str) -> str:
    if not sql.strip():
        raise QueryError(f"no SQL in {'stdin' if source == '-' else source}")
    return sql
