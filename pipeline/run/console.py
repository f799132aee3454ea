"""The console every `arl` command prints to people with.

rich hard-wraps text at the console's width, which for a pipe or a file is 80 columns: a command
or a path printed for copy-paste then breaks across lines. This console never wraps plain text
(`soft_wrap`: a long line stays one line, the terminal folds it visually), and sizes tables to the
terminal, to `$COLUMNS` when set, or to `PIPE_WIDTH` columns when the output is not a terminal.
Tables that must fit choose their columns with `fit_columns`, dropping the least important ones
rather than letting rich cut or wrap their headers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import IO, TypeVar

from rich.console import Console
from rich.table import Table

PIPE_WIDTH = 100
"""Table width when stdout is a pipe or a file and `$COLUMNS` is not set."""

T = TypeVar("T")


def people_console(*, file: IO[str] | None = None, stderr: bool = False, pipe_width: int = PIPE_WIDTH) -> Console:
    """A console for output meant for people: plain text is never hard-wrapped."""
    console = Console(file=file, stderr=stderr, soft_wrap=True)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console.width = pipe_width
    return console


def fit_columns(
    columns: Sequence[T], width_of: Callable[[Sequence[T]], int], width: int, priority: Callable[[T], int]
) -> list[T]:
    """The columns (in their order) whose table fits `width`: drop the highest `priority` number first."""
    kept = list(columns)
    while len(kept) > 1 and width_of(kept) > width:
        kept.remove(max(kept, key=priority))
    return kept


def table_width(console: Console, table: Table) -> int:
    """The width `table` takes when nothing in it is cut or wrapped."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update(width=10_000), table).maximum
