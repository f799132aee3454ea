"""jobs.json plus the records hand-submitted Slurm jobs write for themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.run.jobs import JobRecord, add_record, next_attempt, read_jobs, record_this_slurm_job
from pipeline.run.paths import RunPaths

SLURM_ENV = ("SLURM_JOB_ID", "ARL_ATTEMPT", "ARL_EXECUTOR", "RANK", "SLURM_NODEID", "SLURM_PROCID")


@pytest.fixture
def paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunPaths:
    for key in SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    return RunPaths(tmp_path / "run")


def test_a_hand_submitted_job_records_itself_once(paths: RunPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("ARL_ATTEMPT", "2")
    record = record_this_slurm_job(paths, "rollout")
    assert record is not None and record.job_id == "77" and record.attempt == 2
    assert record_this_slurm_job(paths, "rollout") is None  # a second task of the same job adds nothing
    (stored,) = read_jobs(paths)["rollout"]
    assert (stored.job_id, stored.attempt, stored.executor) == ("77", 2, "slurm")
    assert stored.log == str(paths.stage_log("rollout", 2))
    assert next_attempt(paths, "rollout") == 3


@pytest.mark.parametrize("extra", [{"ARL_EXECUTOR": "local"}, {"RANK": "1"}, {"SLURM_NODEID": "1"}])
def test_only_the_first_task_of_a_slurm_job_records(paths: RunPaths, monkeypatch: pytest.MonkeyPatch,
                                                    extra: dict[str, str]) -> None:  # fmt: skip
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("ARL_ATTEMPT", "1")
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    assert record_this_slurm_job(paths, "train") is None and read_jobs(paths) == {}


def test_without_our_script_nothing_is_recorded(paths: RunPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # e.g. `arl stage train` typed inside an allocation
    assert record_this_slurm_job(paths, "train") is None


def test_the_launchers_record_wins_and_order_is_by_attempt(paths: RunPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "90")
    monkeypatch.setenv("ARL_ATTEMPT", "2")
    record_this_slurm_job(paths, "train")  # the job started before the launcher wrote jobs.json
    add_record(paths, JobRecord(stage="train", attempt=1, executor="slurm", log="a1", host="h", command="c",
                                job_id="80"))  # fmt: skip
    add_record(paths, JobRecord(stage="train", attempt=2, executor="slurm", log="a2", host="h", command="launcher",
                                job_id="90"))  # fmt: skip
    records = read_jobs(paths)["train"]
    assert [(r.attempt, r.job_id, r.command) for r in records] == [(1, "80", "c"), (2, "90", "launcher")]


def test_an_unreadable_self_record_is_skipped(paths: RunPaths) -> None:
    paths.self_recorded_jobs.mkdir(parents=True)
    (paths.self_recorded_jobs / "train.1.5.json").write_text("{not json")
    assert read_jobs(paths) == {}
