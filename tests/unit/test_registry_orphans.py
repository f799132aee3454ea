"""A relaunched inference stage retires the registry entries its ended predecessors could not remove."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pipeline.engine.inference.orphans import retire_orphans
from pipeline.engine.registry import read_entries, retired_since, write_entry
from pipeline.run.jobs import JobRecord, add_record
from pipeline.run.paths import RunPaths
from schemas.engine_api import InferenceEntry


def _entry(attempt: int | None, *, host: str = "node9", pid: int = 4242, started_at: float = 1.0) -> InferenceEntry:
    return InferenceEntry(url=f"http://{host}:{pid}", backend="hf", model_path="/m", weight_version=0, host=host,
                          pid=pid, started_at=started_at, attempt=attempt)  # fmt: skip


def _record(paths: RunPaths, attempt: int, *, pid: int, exit_code: int | None) -> None:
    started = psutil.Process(pid).create_time() if exit_code is None else None
    add_record(paths, JobRecord(stage="inference", attempt=attempt, executor="local", log="l",
                                host=socket.gethostname(), command="c", pid=pid, started_at=started,
                                exit_code=exit_code))  # fmt: skip


def test_entries_of_ended_attempts_are_retired_and_live_ones_kept(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    _record(paths, 1, pid=1, exit_code=-9)  # the attempt that died with its node
    _record(paths, 2, pid=os.getpid(), exit_code=None)  # a second stage started by hand, still running
    write_entry(paths, "node9-1", _entry(1, started_at=11.0))
    write_entry(paths, "node9-2", _entry(2))
    write_entry(paths, "node9-3", _entry(3))  # this attempt's own
    write_entry(paths, "legacy", _entry(None))  # written before entries named their attempt

    assert retire_orphans(paths, 3) == ["node9-1"]
    assert sorted(read_entries(paths)) == ["legacy", "node9-2", "node9-3"]
    note = json.loads(paths.retired_entry("node9-1").read_text())
    assert note["started_at"] == 11.0 and "attempt 1" in note["why"] and "EXITED" in note["why"]
    assert retired_since(paths, {"node9-1": 11.0, "node9-2": 1.0}) == {"node9-1"}
    assert retired_since(paths, {"node9-1": 99.0}) == set()  # a later life of a server with that name


def test_a_server_of_this_host_whose_process_is_gone_is_retired(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_entry(paths, "here-gone", _entry(1, host=socket.gethostname(), pid=gone.pid))
    write_entry(paths, "here-alive", _entry(1, host=socket.gethostname(), pid=os.getpid(), started_at=time.time()))
    write_entry(paths, "elsewhere", _entry(1, host="node9"))  # no record, another host: may still run
    assert retire_orphans(paths, 2) == ["here-gone"]
    assert sorted(read_entries(paths)) == ["elsewhere", "here-alive"]
