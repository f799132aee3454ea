"""`arl status RUN_DIR` and `arl stop RUN_DIR`.

Status reads only the run dir (jobs.json, trajectories, state, metrics) plus the scheduler's or
the OS's view of the recorded ids, so it works from any machine that mounts the run dir (local
pids only on their own host). Stop cancels exactly the recorded Slurm job ids and local process
groups, never anything found by name.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.errors import ArlError, SchemaError
from pipeline.eval.results import evaluation_lines
from pipeline.launch.rundir import resume_command
from pipeline.run.console import fit_columns, people_console, table_width
from pipeline.run.job_state import JobState, pid_is_ours, record_states, unhealthy_nodes
from pipeline.run.jobs import JobRecord, latest, read_jobs, update_record
from pipeline.run.paths import RunPaths
from pipeline.run.progress import records_of, step_table
from pipeline.run.timeline import timeline_lines
from pipeline.run.weight_version import published_version

RECENT_STEPS = 5


def show_status(run_dir: str | Path, *, console: Console | None = None) -> int:
    """Print the run's jobs, progress and recent metrics. Exit status 1 when a stage died, else 0.

    Tables fit the console's width by dropping their least important columns; paths are printed
    on lines of their own, never cut or wrapped."""
    console = console or people_console()
    paths = _run_paths(run_dir)
    newest = latest(read_jobs(paths))
    states = record_states(list(newest.values()))
    console.print(f"run dir: {paths.root}")
    if newest:
        console.print("jobs (newest attempt of each stage):")
        console.print(_jobs_table(newest, states, console))
        console.print("logs:")
        for stage, r in sorted(newest.items()):
            console.print(f"  {stage:<9} {r.log}", markup=False, highlight=False)
    else:
        console.print("no jobs recorded (not launched, or a --dry-run)")
    console.print(_progress_line(paths))
    recent = records_of(paths)[-RECENT_STEPS:]
    if recent:
        console.print(f"last {len(recent)} steps (step k is trained into weight version k+1):")
        console.print(step_table(recent, console))
        trained = [r for r in recent if r.trained]
        lines = timeline_lines(trained[-1]) if trained else []
        if lines:
            console.print(f'step {trained[-1].step} timeline, seconds (docs/operations.md, "Step timeline"):')
            for line in lines:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
    evaluations = evaluation_lines(paths)
    if evaluations:
        console.print("evaluations (in-run and arl eval; the newest of each version and set, docs/evaluation.md):")
        for line in evaluations:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    dead = died(newest, states)
    for record in dead:
        for line in death_report(record, states[(record.stage, record.attempt)], paths):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    return 1 if dead else 0


def death_report(record: JobRecord, state: JobState, paths: RunPaths) -> list[str]:
    """What died where, and what to do: which job, on which node, whether that node is down now."""
    what = f"job {record.job_id}" if record.executor == "slurm" else f"pid {record.pid} on {record.host}"
    where = f" on {state.nodes}" if state.nodes else ""
    lines = [
        f"stage {record.stage} died: {what} (attempt {record.attempt}) ended {state.state}{where}; "
        f"{state.detail}; its log: {record.log}"
    ]
    resume = (
        f"`arl launch CONFIG --resume` (the run's config and overrides, from where it was launched; "
        f"frozen in {paths.config})"
    )
    bad = unhealthy_nodes(state.nodes) if record.executor == "slurm" else {}
    if bad:
        lost = ",".join(bad)
        lines += [f"node {node} is {why} now" for node, why in bad.items()]
        lines.append(
            f"what to do: once {lost} is back in service (`sinfo -n {lost}`), {resume}; or now, without "
            f"it: add cluster.{record.stage}.exclude={lost}"
        )
    elif state.state == "NODE_FAIL":
        lines.append(f"what to do: its node failed and is back in service now: {resume}")
    else:
        lines.append(f"what to do: read the end of its log, fix the cause, then {resume}; live stages are kept")
    return lines


def died(newest: dict[str, JobRecord], states: dict[tuple[str, int], JobState]) -> list[JobRecord]:
    """Latest attempts that ended badly. Once the trainer completed, the others' ends are expected."""
    train = newest.get("train")
    if train is not None and states[("train", train.attempt)].state == "COMPLETED":
        return []
    return [r for r in newest.values() if states[(r.stage, r.attempt)].failed]


def stop_run(run_dir: str | Path, *, grace_s: float = 10.0, console: Console | None = None) -> int:
    """Cancel every live recorded job of the run: `scancel <ids>` for Slurm, SIGTERM/SIGKILL for local pids."""
    from pipeline.launch.slurm import scancel

    console = console or people_console()
    paths = _run_paths(run_dir)
    records = [r for attempts in read_jobs(paths).values() for r in attempts]
    states = record_states(records)
    live = [r for r in records if states[(r.stage, r.attempt)].alive]
    if not live:
        console.print(f"nothing to stop: no live jobs recorded for {paths.root}")
        return 0
    for r in live:  # marked first, so a supervising `arl launch --executor local` sees a stop, not a crash
        r.stopped = True
        update_record(paths, r)
    scancel([r.job_id for r in live if r.executor == "slurm" and r.job_id])
    _stop_pids([r for r in live if r.executor == "local"], grace_s)
    for r in live:
        what = f"job {r.job_id}" if r.executor == "slurm" else f"pid {r.pid}"
        console.print(f"stopped {r.stage} ({what}, attempt {r.attempt})")
    executor = "local" if all(r.executor == "local" for r in live) else "slurm"
    console.print(f"continue the run with: {resume_command(paths, executor)}", markup=False, highlight=False)
    return 0


def _stop_pids(records: list[JobRecord], grace_s: float) -> None:
    for r in records:
        if r.pid is not None:
            _killpg(r.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_is_ours(r.pid, r.started_at) for r in records if r.pid):
        time.sleep(0.2)
    for r in records:
        if r.pid is not None and pid_is_ours(r.pid, r.started_at):
            _killpg(r.pid, signal.SIGKILL)


def _killpg(pgid: int, sig: signal.Signals) -> None:
    """Local stages lead their own process group (the launcher starts each in a new session)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _run_paths(run_dir: str | Path) -> RunPaths:
    paths = RunPaths(Path(run_dir).resolve())
    if not paths.config.exists():
        raise ArlError(f"{run_dir} is not a run dir (no config.yaml); `arl launch` creates one")
    return paths


_JOB_COLUMNS = (("stage", 0), ("attempt", 3), ("job", 1), ("state", 0), ("detail", 2))
"""(header, priority): on a narrow console the highest priority number is dropped first."""


def _jobs_table(newest: dict[str, JobRecord], states: dict[tuple[str, int], JobState], console: Console) -> Table:
    rows = []
    for stage, r in sorted(newest.items()):
        state = states[(stage, r.attempt)]
        style = "red" if state.failed else ("green" if state.alive or state.state == "COMPLETED" else "")
        job = f"slurm {r.job_id}" if r.executor == "slurm" else f"pid {r.pid}"
        shown = f"[{style}]{state.state}[/{style}]" if style else state.state
        rows.append({"stage": stage, "attempt": str(r.attempt), "job": job, "state": shown, "detail": state.detail})

    def build(columns: list[tuple[str, int]]) -> Table:
        table = Table()
        for header, _ in columns:
            table.add_column(header, no_wrap=header != "detail")
        for row in rows:
            table.add_row(*(row[header] for header, _ in columns))
        return table

    kept = fit_columns(_JOB_COLUMNS, lambda cs: table_width(console, build(list(cs))), console.width, lambda c: c[1])
    return build(kept)


def _progress_line(paths: RunPaths) -> str:
    """Steps and versions as the run dir numbers them: step k's trajectories are trained into version k+1."""
    steps = paths.complete_steps()
    version: Any
    try:
        version = published_version(paths)
        trained = f" (steps 0-{version - 1} trained)" if version > 0 else " (the initial model)"
    except SchemaError:
        version, trained = "? (unreadable state/weight_version.json)", ""
    checkpoints = paths.complete_checkpoints()
    step = steps[-1] if steps else "none yet"
    return (
        f"newest complete step: {step} ({len(steps)} complete)\n"
        f"weight version: {version}{trained}   newest checkpoint: "
        f"{f'version {checkpoints[-1]}' if checkpoints else 'none'}"
    )
