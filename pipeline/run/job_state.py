"""The live state of recorded jobs: Slurm (`squeue`, then `sacct`, then `scontrol`) or local processes.

Jobs are looked up by the ids in `jobs.json` only, never by name: two runs may share a job name.
`squeue` knows queued and running jobs; `sacct` (needs accounting) knows finished ones; `scontrol`
remembers a finished job for a few minutes without accounting. A pid counts as ours only if the
process's start time matches the one recorded, because pids are reused.
"""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
from dataclasses import dataclass

from pipeline.run.jobs import JobRecord

FAILED_STATES = frozenset(
    {
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "NODE_FAIL",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "GONE",
        "EXITED",
    }
)
ALIVE_STATES = frozenset(
    {
        "PENDING",
        "RUNNING",
        "CONFIGURING",
        "COMPLETING",
        "REQUEUED",
        "RESIZING",
        "SUSPENDED",
        "STAGE_OUT",
        "SIGNALING",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
    }
)
# Alive but on the way out (e.g. just after `scancel`): squeue shows COMPLETING while sacct may
# already say CANCELLED, so a resume must wait these out rather than keep or double-launch them.
ENDING_STATES = frozenset({"COMPLETING", "SIGNALING", "STAGE_OUT"})


@dataclass(frozen=True)
class JobState:
    state: str
    """Slurm's state word (RUNNING, COMPLETED, FAILED, ...), or for a process RUNNING / EXITED / GONE / REMOTE."""
    alive: bool
    detail: str = ""
    """Node, elapsed time or exit code, when known."""
    nodes: str = ""
    """The Slurm nodes the job ran (or runs) on, as Slurm writes them (`node[1-2]`); "" when unknown."""

    @property
    def failed(self) -> bool:
        return self.state in FAILED_STATES

    @property
    def ending(self) -> bool:
        return self.state in ENDING_STATES


def slurm_available() -> bool:
    return shutil.which("squeue") is not None


def slurm_states(job_ids: list[str]) -> dict[str, JobState]:
    """State of each job id; ids no source knows map to UNKNOWN."""
    states: dict[str, JobState] = {}
    if not job_ids or not slurm_available():
        return {job: JobState("UNKNOWN", alive=False, detail="no Slurm commands here") for job in job_ids}
    wanted = set(job_ids)
    for line in _run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i|%T|%N|%M"]).splitlines():
        job, state, node, elapsed = [*line.split("|"), "", "", ""][:4]
        if job in wanted:
            states[job] = JobState(
                state,
                alive=state in ALIVE_STATES,
                detail=f"{node} {elapsed}".strip(),
                nodes=node if state != "PENDING" else "",
            )
    missing = [job for job in job_ids if job not in states]
    if missing:
        fields = "JobIDRaw,State,ExitCode,Elapsed,NodeList"
        for line in _run(["sacct", "-n", "-P", "-X", "-j", ",".join(missing), "-o", fields]).splitlines():
            job, state, code, elapsed, node = [*line.split("|"), "", "", "", ""][:5]
            if job in wanted and job not in states:
                word = state.split()[0] if state else "UNKNOWN"
                node = "" if node in ("None assigned", "(null)") else node
                where = f" on {node}" if node else ""
                states[job] = JobState(
                    word, alive=word in ALIVE_STATES, detail=f"exit {code} after {elapsed}{where}", nodes=node
                )
    for job in job_ids:
        if job not in states:
            states[job] = _scontrol_state(job)
    return states


def _scontrol_state(job: str) -> JobState:
    fields = dict(item.split("=", 1) for item in _run(["scontrol", "show", "job", "-o", job]).split() if "=" in item)
    state = fields.get("JobState")
    if state is None:
        return JobState("UNKNOWN", alive=False, detail="not in squeue, sacct or scontrol")
    node = fields.get("NodeList", "")
    node = "" if node in ("(null)", "None") else node
    where = f" on {node}" if node else ""
    return JobState(state, alive=state in ALIVE_STATES, detail=f"exit {fields.get('ExitCode', '?')}{where}", nodes=node)


def unhealthy_nodes(nodes: str) -> dict[str, str]:
    """Of the Slurm nodes `nodes` (`node[1-2]` allowed), those down, drained or failing now: node -> state, reason."""
    if not nodes or not slurm_available():
        return {}
    out: dict[str, str] = {}
    for line in _run(["sinfo", "-h", "-N", "-n", nodes, "-o", "%N|%T|%E"]).splitlines():
        node, state, reason = [*line.split("|"), "", ""][:3]
        bad = state.rstrip("*~#!%$@^-").lower()
        if node and node not in out and (state.endswith("*") or bad.startswith(("down", "drain", "fail", "inval"))):
            why = f" ({reason})" if reason and reason != "none" else ""
            out[node] = f"{state}{why}"
    return out


def _run(argv: list[str]) -> str:
    """A Slurm query's stdout; empty when it fails (no accounting, job too old): the caller falls back."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def local_state(record: JobRecord) -> JobState:
    """A local stage process: still ours and running, ended with a recorded exit code, or gone."""
    if record.host != socket.gethostname():
        return JobState("REMOTE", alive=False, detail=f"pid {record.pid} on {record.host}: check there")
    if record.exit_code is not None:
        word = "COMPLETED" if record.exit_code == 0 else ("STOPPED" if record.stopped else "EXITED")
        return JobState(word, alive=False, detail=f"exit {record.exit_code}")
    if record.pid is not None and pid_is_ours(record.pid, record.started_at):
        return JobState("RUNNING", alive=True, detail=f"pid {record.pid}")
    return JobState("GONE", alive=False, detail=f"pid {record.pid} ended without a recorded exit code")


def pid_is_ours(pid: int, started_at: float | None) -> bool:
    """True when `pid` runs and started when we recorded (within 1 s), i.e. it is not a reused pid."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started_at is None or abs(proc.create_time() - started_at) < 1.0
    except psutil.Error:
        return False


def record_states(records: list[JobRecord]) -> dict[tuple[str, int], JobState]:
    """The state of each (stage, attempt), querying Slurm once for all Slurm records."""
    slurm = slurm_states([r.job_id for r in records if r.executor == "slurm" and r.job_id])
    out = {}
    for record in records:
        if record.executor == "slurm":
            state = slurm.get(record.job_id or "", JobState("UNKNOWN", alive=False, detail="no job id recorded"))
            if record.stopped and state.state == "CANCELLED":
                state = JobState("STOPPED", alive=False, detail=state.detail)
            out[(record.stage, record.attempt)] = state
        else:
            out[(record.stage, record.attempt)] = local_state(record)
    return out
