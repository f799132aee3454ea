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
always atomically, so `arl status` / `arl stop` never read a torn file.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.errors import ArlError
from pipeline.handoff import read_json, write_json_atomic
from pipeline.paths import RunPaths


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
    if not paths.jobs.exists():
        return {}
    try:
        data = read_json(paths.jobs)
        return {
            stage: [JobRecord(stage=stage, **entry) for entry in entries]
            for stage, entries in data.get("stages", {}).items()
        }
    except (ValueError, TypeError, AttributeError) as exc:
        raise ArlError(f"{paths.jobs} is not a valid jobs file ({exc}); it is written only by `arl launch`") from None


def write_jobs(paths: RunPaths, jobs: dict[str, list[JobRecord]]) -> None:
    stages = {stage: [r.to_json() for r in records] for stage, records in sorted(jobs.items())}
    write_json_atomic(paths.jobs, {"run_dir": str(paths.root), "stages": stages})


def add_record(paths: RunPaths, record: JobRecord) -> None:
    jobs = read_jobs(paths)
    jobs.setdefault(record.stage, []).append(record)
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
