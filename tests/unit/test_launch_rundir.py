"""Run-dir creation, the refusal messages, resume's config checks, and jobs.json bookkeeping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.errors import ArlError
from pipeline.launch.launcher import launch
from pipeline.launch.rundir import differences, prepare_run_dir, resumable
from pipeline.run.config import load_config
from pipeline.run.job_state import local_state
from pipeline.run.jobs import JobRecord, add_record, latest, next_attempt, read_jobs, update_record
from pipeline.run.paths import RunPaths


def _config(tmp_path: Path, **extra: object) -> Path:
    data = {"fileroot": str(tmp_path / "runs"), "experiment_name": "exp", "trial_name": "t1", "num_steps": 4, **extra}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _record(stage: str, attempt: int, **kwargs: object) -> JobRecord:
    base = {"executor": "local", "log": f"/x/{stage}/attempt_{attempt}.log", "host": "h", "command": "c"}
    return JobRecord(stage=stage, attempt=attempt, **{**base, **kwargs})  # type: ignore[arg-type]


def test_fresh_launch_creates_the_dir_and_freezes_the_resolved_config(tmp_path: Path) -> None:
    config, paths = prepare_run_dir(_config(tmp_path), ["trainer.optimizer.lr=0.001"], resume=False, clean=False)
    assert paths.root == (tmp_path / "runs" / "exp" / "t1").resolve()
    frozen = yaml.safe_load(paths.config.read_text())
    assert frozen["trainer"]["optimizer"]["lr"] == 0.001
    assert frozen["rollout"]["batch_size"] == config.rollout.batch_size  # defaults are written too
    assert not list(paths.root.glob("*.tmp"))


def test_existing_run_dir_is_refused_naming_both_flags(tmp_path: Path) -> None:
    _, paths = prepare_run_dir(_config(tmp_path), [], resume=False, clean=False)
    (paths.root / "jobs.json").write_text("{}")
    with pytest.raises(ArlError, match=r"already exists: pass --resume to continue that run, or --clean"):
        prepare_run_dir(_config(tmp_path), [], resume=False, clean=False)


def test_a_dry_run_leaves_nothing_to_protect(tmp_path: Path) -> None:
    """A dir with only config.yaml and sbatch/ never ran: launching there again needs no flag."""
    _, paths = prepare_run_dir(_config(tmp_path), [], resume=False, clean=False)
    (paths.root / "sbatch").mkdir()
    paths.stage_logs("train").mkdir(parents=True)  # created so plain sbatch can open its --output
    prepare_run_dir(_config(tmp_path), [], resume=False, clean=False)
    paths.stage_log("train", 1).touch()  # a plain-sbatch job ran: now there is something to lose
    with pytest.raises(ArlError, match="already exists"):
        prepare_run_dir(_config(tmp_path), [], resume=False, clean=False)


def test_clean_deletes_the_old_run(tmp_path: Path) -> None:
    _, paths = prepare_run_dir(_config(tmp_path), [], resume=False, clean=False)
    (paths.root / "trajectories").mkdir()
    prepare_run_dir(_config(tmp_path), [], resume=False, clean=True)
    assert not (paths.root / "trajectories").exists() and paths.config.exists()
    assert [p.name for p in paths.root.parent.iterdir()] == ["t1"]


def test_clean_refuses_while_a_stage_still_runs(tmp_path: Path) -> None:
    _, paths = prepare_run_dir(_config(tmp_path), [], resume=False, clean=False)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        import psutil

        record = _record("rollout", 1, pid=sleeper.pid, host=socket.gethostname(),
                         started_at=psutil.Process(sleeper.pid).create_time())  # fmt: skip
        add_record(paths, record)
        with pytest.raises(ArlError, match=rf"still has live jobs: rollout \(pid {sleeper.pid}, RUNNING\).*arl stop"):
            prepare_run_dir(_config(tmp_path), [], resume=False, clean=True)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert paths.jobs.exists()


def test_resume_and_clean_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ArlError, match="not both"):
        prepare_run_dir(_config(tmp_path), [], resume=True, clean=True)


def test_resume_of_a_missing_run_dir_says_so(tmp_path: Path) -> None:
    with pytest.raises(ArlError, match=r"does not exist, so there is nothing to resume; drop --resume"):
        prepare_run_dir(_config(tmp_path), [], resume=True, clean=False)


def test_resume_refuses_a_config_that_changes_results_and_says_what_differs(tmp_path: Path) -> None:
    prepare_run_dir(_config(tmp_path), [], resume=False, clean=False)
    changed = _config(tmp_path, rollout={"group_size": 8})
    with pytest.raises(ArlError, match=r"rollout.group_size: frozen 4, now 8"):
        prepare_run_dir(changed, [], resume=True, clean=False)
    with pytest.raises(ArlError, match=r"trainer.optimizer.lr: frozen 1e-05, now 0.5"):
        prepare_run_dir(_config(tmp_path), ["trainer.optimizer.lr=0.5"], resume=True, clean=False)


def test_resume_keeps_the_frozen_config_and_applies_safe_overrides(tmp_path: Path) -> None:
    prepare_run_dir(_config(tmp_path), ["cluster.train.time_min=30"], resume=False, clean=False)
    harmless = _config(tmp_path, cluster={"train": {"time_min": 999}})
    config, _ = prepare_run_dir(harmless, [], resume=True, clean=False)
    assert config.cluster.train.time_min == 30  # the file's harmless change is not applied silently
    config, paths = prepare_run_dir(harmless, ["num_steps=9", "cluster.train.time_min=45"], resume=True, clean=False)
    assert (config.num_steps, config.cluster.train.time_min) == (9, 45)
    assert load_config(paths.config).num_steps == 9


def test_resume_accepts_the_same_command_line_again(tmp_path: Path) -> None:
    """Users re-run their launch command with --resume: the same overrides must not count as changes."""
    same = ["rollout.group_size=2", "trainer.optimizer.lr=0.01", "trial_name=t2"]
    prepare_run_dir(_config(tmp_path), same, resume=False, clean=False)
    config, paths = prepare_run_dir(_config(tmp_path), same, resume=True, clean=False)
    assert (config.rollout.group_size, config.trial_name) == (2, "t2") and paths.root.name == "t2"


def test_resumable_keys_and_differences() -> None:
    assert resumable("cluster.train.partition") and resumable("num_steps")
    assert not resumable("rollout.batch_size") and not resumable("model.path")
    old, new = load_config(None), load_config(None, ["model.path=/m", "cluster.setup=['a']"])
    assert differences(old, new) == [("cluster.setup", [], ["a"]), ("model.path", "runs/tiny-model", "/m")]


def test_jobs_json_records_attempts_atomically(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    add_record(paths, _record("train", 1, pid=11))
    add_record(paths, _record("rollout", 1, pid=12))
    add_record(paths, _record("train", 2, pid=13))
    done = _record("train", 2, pid=13, exit_code=0)
    update_record(paths, done)
    jobs = read_jobs(paths)
    assert [r.attempt for r in jobs["train"]] == [1, 2]
    assert latest(jobs)["train"].exit_code == 0 and latest(jobs)["rollout"].pid == 12
    on_disk = json.loads(paths.jobs.read_text())
    assert on_disk["run_dir"] == str(tmp_path) and on_disk["stages"]["train"][1]["pid"] == 13
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_next_attempt_counts_records_and_logs(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert next_attempt(paths, "train") == 1
    add_record(paths, _record("train", 1))
    assert next_attempt(paths, "train") == 2
    paths.stage_log("train", 4).parent.mkdir(parents=True)
    paths.stage_log("train", 4).touch()  # a plain-sbatch submission leaves only its log
    assert next_attempt(paths, "train") == 5


def test_a_corrupt_jobs_file_is_a_clear_error(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.jobs.write_text('{"stages": {"train": [{"bogus": 1}]}}')
    with pytest.raises(ArlError, match="not a valid jobs file"):
        read_jobs(paths)


def test_local_state_tells_a_reused_pid_from_ours() -> None:
    import socket

    mine = _record("train", 1, pid=os.getpid(), host=socket.gethostname(), started_at=1.0)  # wrong start time
    assert local_state(mine).state == "GONE"
    assert local_state(_record("train", 1, pid=1, host="elsewhere")).state == "REMOTE"
    assert local_state(_record("train", 1, exit_code=0, host=socket.gethostname())).state == "COMPLETED"
    stopped = _record("train", 1, exit_code=-15, stopped=True, host=socket.gethostname())
    assert local_state(stopped).state == "STOPPED" and not local_state(stopped).failed


def test_launch_rejects_an_unknown_executor(tmp_path: Path) -> None:
    with pytest.raises(ArlError, match="--executor must be one of slurm, local"):
        launch(_config(tmp_path), [], executor="kubernetes")
