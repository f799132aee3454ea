"""Submit stage jobs to Slurm with submitit, and cancel them by job id.

submitit gives us job objects, `sacct`-based state, the remote traceback of a failed job and its
requeue machinery. Its own sbatch file is replaced by arl's template (one `_make_submission_file_text`
override), so a submitted script and a `--dry-run` script differ only in their last line.
The launcher never waits on `job.result()`: stage jobs run for hours, and without accounting a
cancelled job's result never arrives (docs/operations.md, "A Slurm cluster on one machine").
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ArlError
from pipeline.launch.plan import StagePlan, submitit_folder
from pipeline.launch.sbatch import render_sbatch
from pipeline.run.jobs import JobRecord
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig


@dataclass
class StageCommand:
    """What a submitit job calls on each node: the stage's command, its output going to the job's log."""

    argv: list[str]
    log: str

    def __call__(self) -> int:
        code = subprocess.run(self.argv, check=False).returncode
        if code != 0:
            raise RuntimeError(f"stage command exited with code {code}: {shlex.join(self.argv)} (log: {self.log})")
        return 0


def _executor(folder: Path, render: Callable[[str], str], plan: StagePlan, python: str) -> Any:
    import submitit

    class ArlSlurmExecutor(submitit.SlurmExecutor):  # type: ignore[misc]
        """submitit's Slurm executor writing arl's sbatch template instead of its own."""

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return render(command)

    try:
        # submitit's runner line starts with this interpreter: the stage's own (`cluster.python`), as on the node
        executor = ArlSlurmExecutor(folder=folder, python=python)
    except RuntimeError as exc:  # submitit: "Could not detect srun"
        raise ArlError(
            f"cannot submit to Slurm here ({exc}); run on a Slurm login node, or pass --executor local"
        ) from None
    # submitit counts one task per node (what `srun --ntasks-per-node=1` starts) and uses `time`
    # for its timeout bookkeeping; every other option lives in the rendered script.
    executor.parameters.update(nodes=plan.resources.nodes, ntasks_per_node=1, time=plan.resources.time_min)
    return executor


def submit_stage(plan: StagePlan, config: ArlConfig, paths: RunPaths, *, attempt: int, workdir: Path) -> JobRecord:
    """Submit one stage job; returns its `jobs.json` record (the log file exists from now on)."""
    from submitit.core.utils import FailedJobError

    log = paths.stage_log(plan.stage, attempt)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.touch()  # `latest_log(stage)` names this attempt in other stages' wait errors right away

    def render(command: str) -> str:
        return render_sbatch(plan, config, paths, attempt=attempt, workdir=workdir, submitit_command=command)

    executor = _executor(submitit_folder(paths), render, plan, config.cluster.python or sys.executable)
    try:
        job = executor.submit(StageCommand(plan.argv, str(log)))
    except FailedJobError as exc:
        raise ArlError(
            f"sbatch refused the {plan.stage} job: {str(exc).strip()}. Check cluster.{plan.stage} "
            "(partition, account, qos, gpus_per_node, time_min) against `sinfo`"
        ) from None
    return JobRecord(
        stage=plan.stage,
        attempt=attempt,
        executor="slurm",
        log=str(log),
        host=socket.gethostname(),
        command=shlex.join(plan.argv),
        job_id=str(job.job_id),
    )


def submit_script(script: Path) -> str:
    """Plain `sbatch SCRIPT` (what a user does with a prepared script); returns the job id."""
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ArlError(f"sbatch {script} failed: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def scancel(job_ids: list[str]) -> None:
    """Cancel exactly these jobs (by id; Slurm sends SIGTERM, then SIGKILL after its KillWait)."""
    if not job_ids:
        return
    proc = subprocess.run(["scancel", *job_ids], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ArlError(f"scancel {' '.join(job_ids)} failed: {proc.stderr.strip()}")
