"""Writing a query's result: a table for people, or CSV, JSON or Parquet for scripts and files.

The file formats are written by DuckDB itself (`COPY`), straight from the query, so a result of millions
of rows (a `tokens` dump) never passes through Python objects. A file given with `--output` is written
beside its target and renamed onto it: an interrupted query leaves the old file or none, never half a file.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import ArlError

if TYPE_CHECKING:
    import duckdb

FORMATS = ("table", "csv", "json", "parquet")
TABLE_ROWS = 100
"""Rows a table shows when no `--limit` is given (the file formats write every row)."""
_CELL_CHARS = 60
_COPY_OPTIONS = {"csv": "FORMAT csv, HEADER true", "json": "FORMAT json, ARRAY true", "parquet": "FORMAT parquet"}
_RESULT_VIEW = "_arl_result"


def emit(
    con: duckdb.DuckDBPyConnection,
    relation: duckdb.DuckDBPyRelation,
    *,
    fmt: str,
    output: Path | None,
    limit: int | None,
) -> None:
    """Write `relation` (a query's result on `con`) in `fmt` to `output`, or to stdout when it is None."""
    # register, not create_view: a statement DuckDB has already run (SET, CREATE ...) returns rows held in
    # this process, which a view cannot store
    con.register(_RESULT_VIEW, relation)
    if fmt == "table":
        shown = TABLE_ROWS if limit is None else limit
        rows = con.sql(f"SELECT * FROM {_RESULT_VIEW} LIMIT {shown + 1}").fetchall()
        render_table(
            relation.columns,
            [str(t) for t in relation.types],
            rows[:shown],
            cut=len(rows) > shown,
            limit_given=limit is not None,
            output=output,
        )
        return
    select = f"SELECT * FROM {_RESULT_VIEW}" + (f" LIMIT {limit}" if limit is not None else "")
    if output is not None:
        staged = output.with_name(f".{output.name}.{secrets.token_hex(4)}.tmp")
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            _copy(con, select, staged, fmt)
            os.replace(staged, output)
        except OSError as exc:
            raise ArlError(f"--output {output}: cannot write it: {exc.strerror or exc}") from None
        finally:
            staged.unlink(missing_ok=True)
        return
    if fmt == "parquet" and sys.stdout.isatty():
        raise ArlError("--format parquet is binary: give --output FILE (or redirect stdout to a file)")
    with tempfile.TemporaryDirectory(prefix="arl-query-") as tmp:
        staged = Path(tmp) / f"result.{fmt}"
        _copy(con, select, staged, fmt)
        with staged.open("rb") as handle:
            sys.stdout.flush()
            shutil.copyfileobj(handle, sys.stdout.buffer)
            sys.stdout.buffer.flush()


def _copy(con: duckdb.DuckDBPyConnection, select: str, path: Path, fmt: str) -> None:
    target = "'" + str(path).replace("'", "''") + "'"
    con.execute(f"COPY ({select}) TO {target} ({_COPY_OPTIONS[fmt]})")


def render_table(
    columns: list[str],
    types: list[str],
    rows: list[tuple[Any, ...]],
    *,
    cut: bool,
    limit_given: bool,
    output: Path | None = None,
) -> None:
    """A rich table (column name over its type), long cells shortened; a note when rows were left out."""
    from rich.table import Table
    from rich.text import Text

    from pipeline.run.console import people_console

    handle = output.open("w") if output is not None else None
    try:
        console = people_console(file=handle, pipe_width=160)
        table = Table(show_lines=False, header_style="bold")
        for name, kind in zip(columns, types, strict=True):
            table.add_column(
                Text(f"{name}\n{kind.lower()}"), justify="right" if _numeric(kind) else "left", overflow="fold"
            )
        for row in rows:
            table.add_row(*[Text(_cell(value), style="dim" if value is None else "") for value in row])
        console.print(table)
        count = f"{len(rows)} row{'s' * (len(rows) != 1)}"
        if cut:
            how = "raise --limit" if limit_given else f"--limit N shows more than {TABLE_ROWS}"
            count = f"first {count} shown ({how}; --format csv|json|parquet writes every row)"
        console.print(count, style="dim", markup=False, highlight=False)
    finally:
        if handle is not None:
            handle.close()


def _numeric(kind: str) -> bool:
    return kind.upper().split("(")[0] in {
        "TINYINT",
        "SMALLINT",
        "INTEGER",
        "BIGINT",
        "HUGEINT",
        "UTINYINT",
        "USMALLINT",
        "UINTEGER",
        "UBIGINT",
        "FLOAT",
        "DOUBLE",
        "DECIMAL",
    }


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    text = str(value)
    return text if len(text) <= _CELL_CHARS else text[: _CELL_CHARS - 1] + "…"


def one_line(exc: Exception) -> str:
    """DuckDB's message on one line: its kind and text, and any hint it adds ("Candidate bindings: ..."),
    without the `LINE 1: ...` excerpt and its caret, which only make sense in a terminal of their own."""
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = []
    for line in lines:
        if line.startswith("LINE ") or not line or set(line) <= {"^", " "}:
            continue
        kept.append(line)
    return " ".join(kept) or type(exc).__name__
