"""`--executor local`: the same stage commands as local processes, supervised until the trainer ends.

While it waits it prints one line per trained step (`pipeline.run.progress.step_line`), on a
terminal or not, so a piped or logged `arl launch --executor local` shows the run's progress.

Each stage runs in its own session (process group), so the terminal's Ctrl-C reaches only the
launcher, which then stops every stage the same way `arl stop` does: SIGTERM to the group, SIGKILL
after a grace period. The run ends when the trainer exits 0 (its `num_steps` are done: the other
stages are stopped, exit 0) or when any stage fails (the others are stopped, exit 1, naming the
stage and its log).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from pipeline.launch.plan import StagePlan
from pipeline.launch.rundir import resume_command
from pipeline.run.console import people_console
from pipeline.run.jobs import JobRecord, add_record, read_jobs, update_record
from pipeline.run.paths import RunPaths
from pipeline.run.progress import StepFeed, step_line

GRACE_S = 10.0
"""Seconds a stage gets to exit after SIGTERM before SIGKILL."""


class StopRequested(Exception):
    """SIGTERM reached the launcher: stop the stages as for Ctrl-C."""


@dataclass
class Running:
    plan: StagePlan
    record: JobRecord
    proc: subprocess.Popen[bytes]
    log_handle: IO[bytes]


def run_local(
    plans: list[StagePlan],
    paths: RunPaths,
    attempts: dict[str, int],
    *,
    workdir: Path,
    grace_s: float = GRACE_S,
    console: Console | None = None,
) -> int:
    """Start every stage, supervise them, stop them all on the way out; the run's exit status."""
    console = console or people_console()
    running: list[Running] = []
    with _sigterm_raises():
        try:
            for plan in plans:
                running.append(start_stage(plan, paths, attempts[plan.stage], workdir=workdir))
            for r in running:
                console.print(f"  {r.plan.stage:<9} pid {r.proc.pid:<8} tail -F {r.record.log}", soft_wrap=True)
            return supervise(running, paths, console)
        except (KeyboardInterrupt, StopRequested):
            console.print("[yellow]interrupted: stopping every stage[/yellow]")
            console.print(f"continue the run with: {resume_command(paths, 'local')}", markup=False, highlight=False)
            return 130
        finally:
            stop_stages(running, paths, grace_s=grace_s)


def stage_threads(plan: StagePlan) -> dict[str, str]:
    """OpenMP threads of a local stage = its `cpus_per_task`, as a Slurm allocation would give it (unless the
    user's environment sets them). Why: every stage's torch would otherwise start one busy-waiting thread per
    core of the machine, and three stages on a laptop then spin against each other for the same cores."""
    return {"OMP_NUM_THREADS": str(plan.resources.cpus_per_task)}


def start_stage(plan: StagePlan, paths: RunPaths, attempt: int, *, workdir: Path) -> Running:
    log = paths.stage_log(plan.stage, attempt)
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "ab")  # noqa: SIM115 - closed when the process ends (stop_stages / _reap)
    handle.write(
        f"arl: stage {plan.stage} attempt {attempt} on {socket.gethostname()} at "
        f"{time.strftime('%Y-%m-%dT%H:%M:%S')}: {shlex.join(plan.argv)}\n".encode()
    )
    handle.flush()
    env = {
        **stage_threads(plan),
        **os.environ,
        **plan.env,
        "ARL_RUN_DIR": str(paths.root),
        "ARL_STAGE": plan.stage,
        "ARL_ATTEMPT": str(attempt),
        "ARL_EXECUTOR": "local",
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        plan.argv,
        stdout=handle,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=workdir,
        env=env,
        start_new_session=True,
    )
    record = JobRecord(
        stage=plan.stage,
        attempt=attempt,
        executor="local",
        log=str(log),
        host=socket.gethostname(),
        command=shlex.join(plan.argv),
        pid=proc.pid,
        started_at=_create_time(proc.pid),
    )
    add_record(paths, record)
    return Running(plan, record, proc, handle)


def supervise(running: list[Running], paths: RunPaths, console: Console, *, poll_s: float = 0.1) -> int:
    """Wait until the trainer finishes (0) or any stage fails (1), printing each step as it is trained.

    `poll_s` is short because the run's end waits on it (the trainer's exit is noticed here); a poll is a
    `waitpid` per stage and a read of what the metrics files gained."""
    feed = StepFeed(paths, from_now=True)  # a resumed run's earlier steps were shown by its first launch
    while True:
        _print_steps(feed, console)
        for r in running:
            code = r.proc.poll()
            if code is None or r.record.exit_code is not None:
                continue
            _reap(r, paths, code, stopped=False)
            _print_steps(feed, console, final=True)
            if r.record.stopped:
                console.print(f"stage {r.plan.stage} was stopped (`arl stop`): stopping the other stages")
                console.print(f"continue the run with: {resume_command(paths, 'local')}", markup=False, highlight=False)
                return 130
            if code != 0:
                console.print(
                    f"[red]stage {r.plan.stage} failed ({describe_exit(code)}); see its log: {r.record.log}[/red]",
                    soft_wrap=True,
                )
                print_log_tail(console, Path(r.record.log))
                return 1
            if r.plan.stage == "train":
                console.print("trainer finished: stopping the other stages")
                return 0
            console.print(f"stage {r.plan.stage} finished (exit 0)")
        if all(r.record.exit_code is not None for r in running):
            return 0
        time.sleep(poll_s)


def _print_steps(feed: StepFeed, console: Console, *, final: bool = False) -> None:
    for record in feed.poll(final=final):
        console.print(step_line(record), markup=False, highlight=False, soft_wrap=True)


def stop_stages(running: list[Running], paths: RunPaths, *, grace_s: float = GRACE_S) -> None:
    """SIGTERM each live stage's process group, SIGKILL what is left after `grace_s`; record exits."""
    live = [r for r in running if r.record.exit_code is None]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abandon the stop
    try:
        for r in live:
            _signal_group(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for r in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        for r in live:
            if r.proc.poll() is None:
                _signal_group(r.proc.pid, signal.SIGKILL)
            _reap(r, paths, r.proc.wait(), stopped=True)
    finally:
        signal.signal(signal.SIGINT, previous)
        for r in running:
            r.log_handle.close()


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _reap(r: Running, paths: RunPaths, code: int, *, stopped: bool) -> None:
    """Record the exit; `arl stop` may have marked the attempt stopped meanwhile, which is kept."""
    on_disk = [x for x in read_jobs(paths).get(r.plan.stage, []) if x.attempt == r.record.attempt]
    r.record.exit_code = code
    r.record.stopped = stopped or any(x.stopped for x in on_disk)
    r.record.ended_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    update_record(paths, r.record)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal the stage's process group (its id is the stage's pid: `start_new_session`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def print_log_tail(console: Console, log: Path, lines: int = 15) -> None:
    """The end of a failed stage's log, headline first: from the CLI's last `error: ` line when there is one (an
    error's message, often followed by the traceback it carries), else the last `lines` lines."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return
    starts = [i for i, line in enumerate(text) if line.startswith("error: ")]
    shown = text[-lines:]
    if starts and len(text) - starts[-1] > lines:  # the headline, a marker, then the end of what follows it
        skipped = len(text) - starts[-1] - 1 - (lines - 2)
        shown = [text[starts[-1]], f"... ({skipped} lines; the whole log: {log})", *text[-(lines - 2) :]]
    elif starts:
        shown = text[starts[-1] :]
    for line in shown:
        console.print(f"    {line}", markup=False, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise StopRequested()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
