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
from pipeline.launch.jobs import JobRecord, latest, read_jobs, update_record
from pipeline.launch.state import JobState, pid_is_ours, record_states, unhealthy_nodes
from pipeline.metrics import read_jsonl
from pipeline.paths import RunPaths
from pipeline.weight_version import published_version

RECENT_STEPS = 5


def show_status(run_dir: str | Path, *, console: Console | None = None) -> int:
    """Print the run's jobs, progress and recent metrics. Exit status 1 when a stage died, else 0."""
    console = console or Console()
    paths = _run_paths(run_dir)
    newest = latest(read_jobs(paths))
    states = record_states(list(newest.values()))
    console.print(f"run dir: {paths.root}")
    console.print(_jobs_table(newest, states) if newest else "no jobs recorded (not launched, or a --dry-run)")
    console.print(_progress_line(paths))
    recent = _metrics_table(paths)
    if recent is not None:
        console.print(recent)
    dead = died(newest, states)
    for record in dead:
        for line in death_report(record, states[(record.stage, record.attempt)], paths):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    return 1 if dead else 0


def death_report(record: JobRecord, state: JobState, paths: RunPaths) -> list[str]:
    """What died where, and what to do: which job, on which node, whether that node is down now."""
    what = f"job {record.job_id}" if record.executor == "slurm" else f"pid {record.pid} on {record.host}"
    where = f" on {state.nodes}" if state.nodes else ""
    lines = [f"stage {record.stage} died: {what} (attempt {record.attempt}) ended {state.state}{where}; "
             f"{state.detail}; its log: {record.log}"]  # fmt: skip
    resume = (f"`arl launch CONFIG --resume` (the run's config and overrides, from where it was launched; "
              f"frozen in {paths.config})")  # fmt: skip
    bad = unhealthy_nodes(state.nodes) if record.executor == "slurm" else {}
    if bad:
        lost = ",".join(bad)
        lines += [f"node {node} is {why} now" for node, why in bad.items()]
        lines.append(f"what to do: once {lost} is back in service (`sinfo -n {lost}`), {resume}; or now, without "
                     f"it: add cluster.{record.stage}.exclude={lost}")  # fmt: skip
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

    console = console or Console()
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


def _jobs_table(newest: dict[str, JobRecord], states: dict[tuple[str, int], JobState]) -> Table:
    table = Table(title="jobs (newest attempt of each stage)")
    for column in ("stage", "attempt", "job", "state", "detail", "log"):
        table.add_column(column)
    for stage, r in sorted(newest.items()):
        state = states[(stage, r.attempt)]
        style = "red" if state.failed else ("green" if state.alive or state.state == "COMPLETED" else "")
        job = f"slurm {r.job_id}" if r.executor == "slurm" else f"pid {r.pid}"
        table.add_row(stage, str(r.attempt), job, f"[{style}]{state.state}[/{style}]" if style else state.state,
                      state.detail, r.log)  # fmt: skip
    return table


def _progress_line(paths: RunPaths) -> str:
    steps = paths.complete_steps()
    version: Any
    try:
        version = published_version(paths)
    except SchemaError:
        version = "? (unreadable state/weight_version.json)"
    checkpoints = paths.complete_checkpoints()
    step = steps[-1] if steps else "none yet"
    return (f"newest complete step: {step} ({len(steps)} complete)   weight version: {version}   "
            f"newest checkpoint: {checkpoints[-1] if checkpoints else 'none'}")  # fmt: skip


def _metrics_table(paths: RunPaths) -> Table | None:
    rollout = read_jsonl(paths.rollout_metrics)[-RECENT_STEPS:]
    train = {r["step"]: r for r in read_jsonl(paths.train_metrics)}
    if not rollout and not train:
        return None
    rows = rollout or [{"step": s} for s in sorted(train)[-RECENT_STEPS:]]
    keys = _pick_keys(rollout, ("reward",)) + _pick_keys(rollout, ("len", "tokens"))
    train_keys = _pick_keys(list(train.values()), ("loss",))
    table = Table(title=f"last {len(rows)} steps")
    for column in ("step", *keys, *(f"train {k}" for k in train_keys)):
        table.add_column(column, justify="right")
    for row in rows:
        step = row.get("step")
        trained = train.get(step, {}) if isinstance(step, int) else {}
        cells = [_fmt(row.get(k)) for k in keys] + [_fmt(trained.get(k)) for k in train_keys]
        table.add_row(str(step), *cells)
    return table


def _pick_keys(records: list[dict[str, Any]], needles: tuple[str, ...], most: int = 3) -> list[str]:
    """Numeric metric names containing one of `needles`, `*_mean` first (the stages name their own metrics)."""
    found: list[str] = []
    for record in records:
        for key, value in record.items():
            if key in found or key in ("step", "time") or not isinstance(value, int | float):
                continue
            if any(n in key.lower() for n in needles):
                found.append(key)
    found.sort(key=lambda k: (not k.endswith("mean"), k))
    return found[:most]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
