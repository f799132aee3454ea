"""Atomic publication and deadline waits, including a writer SIGKILLed while a reader watches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pipeline.errors import WaitTimeout
from pipeline.run.handoff import (
    clean_stale_tmp,
    publish_dir,
    read_json,
    remove_published,
    staging_dir,
    wait_for,
    write_json_atomic,
    write_text_atomic,
)

REPO = Path(__file__).resolve().parents[2]

_WRITER = textwrap.dedent(
    """
    import sys
    from pipeline.run.handoff import write_json_atomic
    target = sys.argv[1]
    n = 0
    while True:
        n += 1
        # ~1 MB per version, every element equal to the version: a torn file would not parse or not agree.
        write_json_atomic(target, {"n": n, "data": [n] * 150_000})
        if n == 3:
            print("writing", flush=True)
    """
)


def test_atomic_write_is_never_seen_torn_even_when_the_writer_is_killed(tmp_path: Path) -> None:
    target = tmp_path / "shared" / "state.json"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        seen: set[int] = set()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            doc = json.loads(target.read_text())  # raises on a torn file
            assert set(doc["data"]) == {doc["n"]} and len(doc["data"]) == 150_000
            seen.add(doc["n"])
        assert len(seen) >= 2, "the writer made no progress while we watched"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    final = read_json(target)
    assert set(final["data"]) == {final["n"]}
    # Whatever the kill left behind is only temp files, which the sweeper removes.
    leftovers = [p for p in target.parent.iterdir() if p != target]
    assert all(p.name.endswith(".tmp") for p in leftovers)
    assert sorted(clean_stale_tmp(target.parent)) == sorted(leftovers)
    assert list(target.parent.iterdir()) == [target]


def test_write_text_atomic_replaces_and_creates_parents(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "LATEST"
    write_text_atomic(path, "3")
    write_text_atomic(path, "4")
    assert path.read_text() == "4" and list(path.parent.iterdir()) == [path]


def test_publish_dir_replaces_the_old_version_whole(tmp_path: Path) -> None:
    final = tmp_path / "trajectories" / "step_000001"
    with staging_dir(final) as staged:
        (staged / "part-a.parquet").write_text("a")
        (staged / "part-b.parquet").write_text("b")
        publish_dir(staged, final, "_MANIFEST.json", {"parts": 2})
    assert sorted(p.name for p in final.iterdir()) == ["_MANIFEST.json", "part-a.parquet", "part-b.parquet"]
    with staging_dir(final) as staged:
        (staged / "part-c.parquet").write_text("c")
        assert not (staged / "_MANIFEST.json").exists()
        publish_dir(staged, final, "_MANIFEST.json", {"parts": 1})
    assert sorted(p.name for p in final.iterdir()) == ["_MANIFEST.json", "part-c.parquet"]
    assert read_json(final / "_MANIFEST.json") == {"parts": 1}
    assert [p.name for p in final.parent.iterdir()] == ["step_000001"]  # no staging or .old leftovers
    remove_published(final)
    assert not final.exists() and list(final.parent.iterdir()) == []
    remove_published(final)  # idempotent


def test_staging_dir_is_removed_when_the_block_fails(tmp_path: Path) -> None:
    final = tmp_path / "checkpoints" / "step_000002"
    with pytest.raises(RuntimeError), staging_dir(final) as staged:
        (staged / "model.safetensors").write_text("half")
        raise RuntimeError("writer failed")
    assert list(final.parent.iterdir()) == [] and not final.exists()


def test_clean_stale_tmp_removes_only_temp_entries(tmp_path: Path) -> None:
    assert clean_stale_tmp(tmp_path / "missing") == []
    (tmp_path / "step_000003.ab12cd34.tmp").mkdir()
    (tmp_path / "step_000003.ab12cd34.tmp" / "part-x.parquet").write_text("x")
    (tmp_path / "LATEST.1234abcd.tmp").write_text("5")
    (tmp_path / "step_000003").mkdir()
    (tmp_path / "LATEST").write_text("4")
    removed = clean_stale_tmp(tmp_path)
    assert sorted(p.name for p in removed) == ["LATEST.1234abcd.tmp", "step_000003.ab12cd34.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_000003"]


def test_wait_for_a_path_and_a_callable(tmp_path: Path) -> None:
    target = tmp_path / "late.json"
    threading.Timer(0.2, lambda: write_json_atomic(target, {"ok": True})).start()
    polls: list[float] = []
    got = wait_for(target, what="the late file", upstream="train", log=None, timeout_s=10, poll_s=0.02,
                   on_poll=polls.append)  # fmt: skip
    assert got == target and polls and all(p > 0 for p in polls)
    values = iter([None, None, 42])
    assert wait_for(lambda: next(values), what="x", upstream="rollout", log=None, timeout_s=5, poll_s=0.01) == 42


def test_wait_for_timeout_names_what_upstream_and_log(tmp_path: Path) -> None:
    missing = tmp_path / "trajectories" / "step_000004" / "_MANIFEST.json"
    log = tmp_path / "logs" / "rollout" / "attempt_2.log"
    with pytest.raises(WaitTimeout) as info:
        wait_for(missing, what=f"trajectories of step 4 ({missing})", upstream="rollout", log=log, timeout_s=0.2,
                 poll_s=0.05)  # fmt: skip
    message = str(info.value)
    assert str(missing) in message and "rollout stage" in message and str(log) in message
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(WaitTimeout, match="train stage"):
        wait_for(lambda: None, what="weights", upstream="train", log=None, timeout_s=0.0)
