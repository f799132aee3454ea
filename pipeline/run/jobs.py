"""`jobs.json`: every job (Slurm job id or local pid) of every stage, per attempt.

Example:

    {
      "run_dir": "/shared/runs/demo/trial0",
      "stages": {
        "train": [
          {"attempt": 1, "executor": "slurm", "job_id": "4242", "pid": null, "host": "login1",
           "log": "/shared/runs/demo/trial0/logs/train/attempt_1.log", "submitted_at": "2026-11-22T15:04:05Z",
           "command": "python -m pipeline.cli stage train --run-dir ...", "exit_code": null, "ended_at": null}
        ]
      }
    }

Only the launcher writes it (one process per launch; a second launch refuses while jobs run),
always atomically, so `arl status` / `arl stop` never read a torn file. A stage job submitted by
hand (`sbatch` of a prepared script) records itself instead, in a file of its own under
`sbatch/self_recorded/` (so concurrent jobs never rewrite a shared file); readers merge the two.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.errors import ArlError
from pipeline.run.handoff import read_json, write_json_atomic
from pipeline.run.paths import RunPaths


@dataclass
class JobRecord:
    """One attempt of one stage."""

    stage: str
    attempt: int
    executor: str
    """`slurm` or `local`."""
    log: str
    """Absolute path of the attempt's log (`logs/<stage>/attempt_<n>.log`)."""
    host: str
    """Where it was submitted (Slurm) or runs (local: a pid means something only there)."""
    command: str
    job_id: str | None = None
    pid: int | None = None
    started_at: float | None = None
    """Epoch seconds the local process started (tells our pid from a reused one)."""
    submitted_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    exit_code: int | None = None
    """Set by the local launcher when the process ends."""
    ended_at: str | None = None
    stopped: bool = False
    """Ended on purpose (`arl stop`, or the local launcher after the trainer finished): not a failure."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["stage"]  # the key it is stored under
        return data


def read_jobs(paths: RunPaths) -> dict[str, list[JobRecord]]:
    """Every recorded attempt per stage, oldest first; empty when the run never submitted anything."""
    jobs: dict[str, list[JobRecord]] = {}
    if paths.jobs.exists():
        try:
            data = read_json(paths.jobs)
            jobs = {
                stage: [JobRecord(stage=stage, **entry) for entry in entries]
                for stage, entries in data.get("stages", {}).items()
            }
        except (ValueError, TypeError, AttributeError) as exc:
            raise ArlError(
                f"{paths.jobs} is not a valid jobs file ({exc}); it is written only by `arl launch`"
            ) from None
    for record in _self_recorded(paths):
        known = jobs.setdefault(record.stage, [])
        if all(r.job_id != record.job_id for r in known):  # the launcher's own record of a job wins
            known.append(record)
            known.sort(key=lambda r: (r.attempt, r.submitted_at))
    return jobs


def _self_recorded(paths: RunPaths) -> list[JobRecord]:
    """The records Slurm jobs wrote for themselves; an unreadable one is skipped (it names no job we can act on)."""
    folder = paths.self_recorded_jobs
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            out.append(JobRecord(**read_json(path)))
        except (ValueError, TypeError, OSError):
            continue
    return out


def record_this_slurm_job(paths: RunPaths, stage: str) -> JobRecord | None:
    """Record the running stage when it is a Slurm job started from our sbatch script by hand.

    Jobs `arl launch` submits are recorded by the launcher, but a prepared script submitted with plain
    `sbatch` would otherwise be invisible to `arl status` and `arl stop`. Only the job's first task
    records (one file per job id); the local executor (ARL_EXECUTOR=local) and runs without
    ARL_ATTEMPT (not started from our script) never do.
    """
    env = os.environ
    job_id, attempt = env.get("SLURM_JOB_ID"), env.get("ARL_ATTEMPT")
    first_task = all(env.get(key, "0") == "0" for key in ("RANK", "SLURM_NODEID", "SLURM_PROCID"))
    if not job_id or not attempt or env.get("ARL_EXECUTOR") == "local" or not first_task:
        return None
    if any(r.job_id == job_id for r in read_jobs(paths).get(stage, [])):
        return None
    log = paths.stage_log(stage, int(attempt))
    record = JobRecord(
        stage=stage,
        attempt=int(attempt),
        executor="slurm",
        log=str(log),
        host=socket.gethostname(),
        command=shlex.join(sys.argv),
        job_id=job_id,
    )
    write_json_atomic(paths.self_recorded_jobs / f"{stage}.{attempt}.{job_id}.json", asdict(record))
    return record


def write_jobs(paths: RunPaths, jobs: dict[str, list[JobRecord]]) -> None:
    stages = {stage: [r.to_json() for r in records] for stage, records in sorted(jobs.items())}
    write_json_atomic(paths.jobs, {"run_dir": str(paths.root), "stages": stages})


def add_record(paths: RunPaths, record: JobRecord) -> None:
    jobs = read_jobs(paths)
    known = jobs.setdefault(record.stage, [])
    # A fast job may have recorded itself before its submitter got here: one record per job id.
    known[:] = [r for r in known if record.job_id is None or r.job_id != record.job_id]
    known.append(record)
    write_jobs(paths, jobs)


def update_record(paths: RunPaths, record: JobRecord) -> None:
    """Replace the stored attempt `record.attempt` of `record.stage` (e.g. with its exit code)."""
    jobs = read_jobs(paths)
    records = jobs.setdefault(record.stage, [])
    jobs[record.stage] = [record if r.attempt == record.attempt else r for r in records]
    if all(r.attempt != record.attempt for r in records):
        jobs[record.stage].append(record)
    write_jobs(paths, jobs)


def latest(jobs: dict[str, list[JobRecord]]) -> dict[str, JobRecord]:
    """The newest attempt of each stage."""
    return {stage: max(records, key=lambda r: r.attempt) for stage, records in jobs.items() if records}


def next_attempt(paths: RunPaths, stage: str) -> int:
    """One past both the newest recorded attempt and the newest log (a plain-sbatch run leaves only a log)."""
    recorded = [r.attempt for r in read_jobs(paths).get(stage, [])]
    return max(paths.next_attempt(stage), max(recorded, default=0) + 1)
