"""`arl check CONFIG`: every pre-launch check, as a table; and `require`, the gate `arl launch` passes first.

Exit status 0 when nothing is wrong, 2 when something is: each problem is one line naming the config
key, its value and the fix, and nothing has been written or submitted (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.errors import ArlError
from pipeline.launch.preflight import (
    Outcome,
    PreflightError,
    check_agent_and_data,
    check_engine,
    check_eval_sets,
    check_fileroot,
    check_model,
    check_template,
)
from pipeline.launch.slurm_fit import check_slurm
from schemas.config import ArlConfig


def run_checks(config: ArlConfig, *, executor: str, submit: bool) -> list[Outcome]:
    """Every check that applies; `submit`: jobs will really be queued (a dry run reads Slurm only if it is here)."""
    tokenizers: dict[str, Any] = {}  # loaded once, by the model check, for the template check
    checks: list[tuple[str, Callable[[], Outcome]]] = [
        ("model and tokenizer", lambda: check_model(config, tokenizers)),
        ("chat template", lambda: check_template(config, tokenizers)),
        ("agent and dataset", lambda: check_agent_and_data(config)),
        ("eval sets", lambda: check_eval_sets(config)),
        ("inference engine", lambda: check_engine(config, executor)),
        ("slurm resources", lambda: check_slurm(config, executor=executor, submit=submit)),
        ("file root", lambda: check_fileroot(config)),
    ]
    outcomes = []
    for name, check in checks:
        started = time.monotonic()
        outcome = check()
        outcome.name, outcome.seconds = name, time.monotonic() - started
        outcomes.append(outcome)
    return outcomes


def require(config: ArlConfig, *, executor: str, submit: bool, workdir: Path | None = None) -> None:
    """`arl launch`'s gate: raise `PreflightError` naming every problem, before anything is written.

    Relative paths are checked from `workdir`, where the jobs will start (`cluster.workdir`)."""
    with _inside(workdir):
        problems = [p for o in run_checks(config, executor=executor, submit=submit) for p in o.problems]
    if problems:
        raise PreflightError(problems)


@contextlib.contextmanager
def _inside(workdir: Path | None) -> Iterator[None]:
    if workdir is None or Path(workdir).absolute() == Path.cwd():
        yield
        return
    if not Path(workdir).is_dir():
        raise ArlError(
            f"cluster.workdir={str(workdir)!r}: no such directory here; the jobs start there, so it must "
            "be a directory on a file system the nodes and this machine share"
        )
    before = Path.cwd()
    os.chdir(workdir)
    try:
        yield
    finally:
        os.chdir(before)


def warn_if_python_not_shared(config: ArlConfig, console: Console) -> None:
    """The jobs run the launcher's interpreter unless `cluster.python` says otherwise: say so when that
    interpreter does not live on the file system of `fileroot` (which the nodes mount), where they may not see it."""
    if config.cluster.python:
        return
    root = Path(config.fileroot).absolute()
    existing = next(p for p in (root, *root.parents) if p.exists())
    interpreter = Path(sys.executable)
    if interpreter.stat().st_dev != existing.stat().st_dev:
        console.print(
            f"warning: the jobs will run {interpreter} (this launch's interpreter), which is not on the "
            f"file system of fileroot ({existing}): if the nodes do not see it at that path, set "
            "cluster.python (e.g. python, with a cluster.setup line activating a venv they see)",
            markup=False,
            highlight=False,
            style="yellow",
        )


def check_command(
    config_path: Path | None, overrides: list[str], *, executor: str, console: Console | None = None
) -> int:
    """`arl check`: the table, then the problems one per line; 0 when there are none, else 2."""
    from pipeline.run.config import load_config

    console = console or Console(soft_wrap=True)
    config = load_config(config_path, overrides)
    workdir = Path(config.cluster.workdir) if config.cluster.workdir and executor == "slurm" else None
    with _inside(workdir):
        outcomes = run_checks(config, executor=executor, submit=True)
    table = Table(title=f"arl check ({executor} executor)")
    for column in ("check", "result", "time", "detail"):
        table.add_column(column, overflow="fold")
    for o in outcomes:
        result = "[red]FAIL[/red]" if o.problems else ("skip" if o.skipped else "[green]ok[/green]")
        found = f"{', '.join(p.key for p in o.problems)}: see below" if o.problems else o.detail
        table.add_row(o.name, result, f"{o.seconds:.1f}s", found)
    console.print(table)
    problems = [p for o in outcomes for p in o.problems]
    for problem in problems:
        console.print(f"error: {problem}", markup=False, highlight=False, style="red")
    if not problems:
        console.print("no problems found")
    return 2 if problems else 0
