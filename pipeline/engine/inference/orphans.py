"""Registry entries nobody supervises any more: servers of an inference stage attempt that has ended.

A stage stopped normally deregisters its servers. One that died with its node (SIGKILL, a crashed
machine) cannot: its entries stay, pointing at servers that will never answer again, and a trainer that
took such a server out after a failed swap would wait for it to come back until its deadline. So a
relaunched inference stage, before starting its own servers, retires the entries of earlier attempts
whose stage is known to have ended: by the scheduler's (or the process table's) state of that attempt
in `jobs.json`, or, for a server on this very host, because its process is gone. An entry of an
attempt that may still run (a second inference stage started by hand) is left alone.
"""

from __future__ import annotations

import socket

from pipeline.engine.registry import read_entries, retire_entry
from pipeline.run.job_state import pid_is_ours, record_states
from pipeline.run.jobs import read_jobs
from pipeline.run.paths import RunPaths
from schemas.engine_api import InferenceEntry


def retire_orphans(paths: RunPaths, attempt: int) -> list[str]:
    """Retire the entries of earlier attempts whose stage has ended; returns the retired servers' names."""
    older = {name: e for name, e in read_entries(paths).items() if e.attempt is not None and e.attempt < attempt}
    if not older:
        return []
    ended = _ended_attempts(paths, {e.attempt for e in older.values() if e.attempt is not None})
    retired = []
    for name, entry in sorted(older.items()):
        if entry.attempt in ended:
            why = f"its inference stage (attempt {entry.attempt}) ended {ended[entry.attempt]}"
        elif _gone_here(entry):
            why = f"its process (pid {entry.pid} on {entry.host}) is gone"
        else:
            continue
        retire_entry(paths, name, entry, f"{why}; attempt {attempt} replaces it")
        retired.append(name)
    return retired


def _ended_attempts(paths: RunPaths, attempts: set[int]) -> dict[int, str]:
    """Of the inference attempts `attempts`, those `jobs.json` records and their job or process has ended."""
    records = [r for r in read_jobs(paths).get("inference", []) if r.attempt in attempts]
    states = record_states(records)
    return {
        r.attempt: state.state
        for r in records
        if not (state := states[("inference", r.attempt)]).alive and state.state not in ("UNKNOWN", "REMOTE")
    }


def _gone_here(entry: InferenceEntry) -> bool:
    return entry.host == socket.gethostname() and not pid_is_ours(entry.pid, None)
