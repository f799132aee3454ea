"""`arl launch / status / stop` as subprocesses: local processes, and jobs on the real local Slurm cluster.

The stages are replaced by stand-ins (`FAKE_STAGE` below) written into a temp work dir as a
`stages` package that shadows the real one (`python -m` puts the work dir first on sys.path).
They fake exactly one thing, the stage's work: each records that it ran (a marker file in the run
dir), then sleeps, fails or finishes as the test's environment asks. Everything around them is
real: the CLI, the run dir, jobs.json, processes and signals, sbatch/submitit/squeue/sacct/scancel.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

FAKE_STAGE = '''
"""Stand-in for a real stage: records that it ran, then behaves as FAKE_* variables say."""
import os, signal, sys, time
from pathlib import Path


def main(run_dir, step=None):
    stage = __name__.rsplit(".", 1)[-1]
    out = Path(run_dir) / "fake"
    out.mkdir(exist_ok=True)
    tag = f"{stage}.{os.environ.get('ARL_ATTEMPT', '?')}"
    if "RANK" in os.environ:  # under torchrun
        tag += f".rank{os.environ['RANK']}"

    def on_term(signum, frame):
        (out / f"{tag}.sigterm").write_text("")
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    (out / f"{tag}.started").write_text(str(os.getpid()))
    print(f"fake {tag} running in {os.getcwd()}", flush=True)
    if os.environ.get("FAKE_FAIL") == stage:
        # fail only once the named stages have installed their SIGTERM handler, so the test sees how they stop
        waits = [w for w in os.environ.get("FAKE_FAIL_AFTER", "").split(",") if w]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((out / f"{w}.1.started").exists() for w in waits):
            time.sleep(0.05)
        print(f"fake {stage}: failing on purpose", flush=True)
        return 3
    if stage == "train" and os.environ.get("FAKE_TRAIN_FOREVER") != "1":
        time.sleep(float(os.environ.get("FAKE_TRAIN_S", "1")))
        (out / f"{tag}.done").write_text("")
        return 0
    while True:
        time.sleep(0.1)
'''

STAGE_NAMES = ("inference", "rollout", "proxy", "train")


@pytest.fixture
def workdir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A work dir holding the stand-in `stages` package and a config whose run dir lives under it (with a real
    model, agent and dataset: `arl launch` checks them before it writes or submits anything)."""
    pkg = tmp_path / "stages"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in STAGE_NAMES:
        (pkg / f"{name}.py").write_text(FAKE_STAGE)
    config = {"fileroot": str(tmp_path / "runs"), "experiment_name": "e2e", "trial_name": "t", "num_steps": 2,
              "model": {"path": str(tiny_model_dir)},
              "rollout": {"agent": f"{REPO}/examples/demo_agent.py:DemoAgent",
                          "dataset": {"path": f"{REPO}/examples/data/demo.jsonl"}}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def run_dir(workdir: Path) -> Path:
    return workdir / "runs" / "e2e" / "t"


def arl(workdir: Path, *args: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=workdir, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200", **(env or {})}, timeout=timeout)  # fmt: skip


def arl_bg(workdir: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """The launcher as a person starts it from a terminal: Ctrl-C (SIGINT) reaches it. A test run started in the
    background by a non-interactive shell (`.ci/run &`) inherits SIGINT *ignored*, and Python keeps an ignored
    SIGINT ignored, so the launcher under test must get the default disposition back."""
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=workdir, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_default_sigint,
                            env={**os.environ, "COLUMNS": "200", **env})  # fmt: skip


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def markers(workdir: Path) -> set[str]:
    fake = run_dir(workdir) / "fake"
    return {p.name for p in fake.iterdir()} if fake.exists() else set()


def jobs(workdir: Path) -> dict[str, list[dict]]:
    return json.loads((run_dir(workdir) / "jobs.json").read_text())["stages"]


def _kill_recorded_stages(workdir: Path) -> None:
    """After a failed test, end the stand-in stages the launcher started (their own sessions outlive it)."""
    for entries in jobs(workdir).values():
        with contextlib.suppress(ProcessLookupError, PermissionError, KeyError):
            os.killpg(entries[-1]["pid"], signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- local executor ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_local_run_ends_with_the_trainer_and_resume_makes_new_attempts(workdir: Path) -> None:
    result = arl(workdir, "launch", "config.yaml", "--executor", "local", env={"FAKE_TRAIN_S": "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tail -F" in result.stdout and "trainer finished" in result.stdout
    recorded = jobs(workdir)
    assert sorted(recorded) == ["inference", "rollout", "train"]
    assert recorded["train"][0]["exit_code"] == 0 and not recorded["train"][0]["stopped"]
    for stage in ("inference", "rollout"):
        entry = recorded[stage][0]
        assert entry["stopped"] and entry["exit_code"] is not None and not pid_alive(entry["pid"])
        assert f"{stage}.1.sigterm" in markers(workdir)  # stopped with SIGTERM, not killed
    log = (run_dir(workdir) / "logs" / "rollout" / "attempt_1.log").read_text()
    assert "fake rollout.1 running in " + str(workdir) in log

    again = arl(workdir, "launch", "config.yaml", "--executor", "local")
    assert again.returncode == 2 and "--resume" in again.stderr and "--clean" in again.stderr

    resumed = arl(workdir, "launch", "config.yaml", "--executor", "local", "--resume", env={"FAKE_TRAIN_S": "1"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [e["attempt"] for e in jobs(workdir)["train"]] == [1, 2]
    assert {"train.2.started", "train.2.done", "inference.2.started"} <= markers(workdir)
    assert (run_dir(workdir) / "logs" / "train" / "attempt_2.log").exists()

    status = arl(workdir, "status", str(run_dir(workdir)))
    assert status.returncode == 0, status.stdout
    assert "COMPLETED" in status.stdout and "STOPPED" in status.stdout


def test_a_failing_stage_stops_the_run_and_is_named_with_its_log(workdir: Path) -> None:
    result = arl(workdir, "launch", "config.yaml", "--executor", "local",
                 env={"FAKE_FAIL": "rollout", "FAKE_FAIL_AFTER": "train,inference",
                      "FAKE_TRAIN_FOREVER": "1"})  # fmt: skip
    assert result.returncode == 1
    log = run_dir(workdir) / "logs" / "rollout" / "attempt_1.log"
    assert f"stage rollout failed (exit code 3); see its log: {log}" in " ".join(result.stdout.split())
    assert "failing on purpose" in result.stdout  # the log's tail is shown
    assert {"train.1.sigterm", "inference.1.sigterm"} <= markers(workdir)
    status = arl(workdir, "status", str(run_dir(workdir)))
    assert status.returncode == 1
    assert "ended EXITED; exit 3; its log:" in " ".join(status.stdout.split())


def test_ctrl_c_stops_every_stage(workdir: Path) -> None:
    launcher = arl_bg(workdir, "launch", "config.yaml", "--executor", "local", env={"FAKE_TRAIN_FOREVER": "1"})
    try:
        wait_until(lambda: {f"{s}.1.started" for s in ("inference", "rollout", "train")} <= markers(workdir),
                   "all three stand-in stages to start")  # fmt: skip
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            _kill_recorded_stages(workdir)
    assert launcher.returncode == 130, out
    resume = f"continue the run with: arl launch {run_dir(workdir) / 'config.yaml'} --resume --executor local"
    assert resume in " ".join(out.split()), "a deliberate stop says how to go on"
    assert {f"{s}.1.sigterm" for s in ("inference", "rollout", "train")} <= markers(workdir)
    for entries in jobs(workdir).values():
        assert entries[0]["stopped"] and not pid_alive(entries[0]["pid"])


def test_status_and_stop_of_a_local_run(workdir: Path) -> None:
    launcher = arl_bg(workdir, "launch", "config.yaml", "--executor", "local", env={"FAKE_TRAIN_FOREVER": "1"})
    try:
        wait_until(lambda: "train.1.started" in markers(workdir) and "rollout.1.started" in markers(workdir),
                   "the stand-in stages to start")  # fmt: skip
        status = arl(workdir, "status", str(run_dir(workdir)))
        assert status.returncode == 0, status.stdout
        train_pid = jobs(workdir)["train"][0]["pid"]
        assert "RUNNING" in status.stdout and f"pid {train_pid}" in status.stdout
        stop = arl(workdir, "stop", str(run_dir(workdir)))
        assert stop.returncode == 0 and f"stopped train (pid {train_pid}" in stop.stdout
        assert "--resume --executor local" in " ".join(stop.stdout.split()), "arl stop says how to continue"
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130 and "was stopped" in out and "continue the run with: arl launch" in out
    assert not any(pid_alive(e[0]["pid"]) for e in jobs(workdir).values())
    assert "nothing to stop" in arl(workdir, "stop", str(run_dir(workdir))).stdout


def test_torchrun_line_starts_one_process_per_gpu(workdir: Path) -> None:
    """The multi-GPU trainer command really runs under torchrun (2 CPU processes stand in for 2 GPUs)."""
    from pipeline.launch.plan import plan_stage
    from pipeline.run.config import load_config

    config = load_config(workdir / "config.yaml", ["cluster.train.gpus_per_node=2"])
    plan = plan_stage(config, "train", run_dir(workdir))
    run_dir(workdir).mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SLURM_JOB_ID": "7",
           "ARL_ATTEMPT": "1", "FAKE_TRAIN_S": "0"}  # fmt: skip
    proc = subprocess.run(plan.argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"train.1.rank0.done", "train.1.rank1.done"} <= markers(workdir)


# -- the real local Slurm cluster ---------------------------------------------------------------------


def _slurm_up() -> str | None:
    """None when a Slurm cluster answers here, else why the slurm tests skip."""
    if shutil.which("sinfo") is None:
        return "Slurm commands not installed (run scripts/local_slurm.sh up)"
    probe = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or "up" not in probe.stdout:
        return f"local Slurm cluster is down (scripts/local_slurm.sh up): {probe.stderr.strip()[:200]}"
    return None


slurm = pytest.mark.skipif(_slurm_up() is not None, reason=_slurm_up() or "")


def sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True)
    return (out.stdout.split() or ["?"])[0]


def ended(job_id: str, state: str) -> bool:
    """sacct has the final state and squeue no longer lists the job (it stays COMPLETING there a moment)."""
    queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
    return sacct_state(job_id) == state and not queued.strip()


@pytest.mark.slurm
@pytest.mark.slow
@slurm
def test_slurm_jobs_run_report_status_stop_by_id_and_resume(workdir: Path) -> None:
    result = arl(workdir, "launch", "config.yaml", "--executor", "slurm", env={"FAKE_TRAIN_FOREVER": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    ids = {stage: entries[0]["job_id"] for stage, entries in jobs(workdir).items()}
    assert sorted(ids) == ["inference", "rollout", "train"] and all(i.isdigit() for i in ids.values())
    assert "tail -F" in result.stdout and all(f"job {i}" in result.stdout for i in ids.values())
    wait_until(lambda: {f"{s}.1.started" for s in ids} <= markers(workdir), "the three Slurm jobs to run")
    status = arl(workdir, "status", str(run_dir(workdir)))
    assert status.returncode == 0 and status.stdout.count("RUNNING") == 3, status.stdout

    # the trainer is cancelled (by id) mid-run; resume relaunches it and keeps the live servers
    subprocess.run(["scancel", ids["train"]], check=True)
    wait_until(lambda: sacct_state(ids["train"]) == "CANCELLED", f"job {ids['train']} to be cancelled")
    resumed = arl(workdir, "launch", "config.yaml", "--executor", "slurm", "--resume", env={"FAKE_TRAIN_FOREVER": "1"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "inference still running" in " ".join(resumed.stdout.split())
    recorded = jobs(workdir)
    assert [e["attempt"] for e in recorded["train"]] == [1, 2] and len(recorded["inference"]) == 1
    wait_until(lambda: "train.2.started" in markers(workdir), "the resumed trainer to run")

    stop = arl(workdir, "stop", str(run_dir(workdir)))
    assert stop.returncode == 0, stop.stdout
    new_train = jobs(workdir)["train"][1]["job_id"]
    for job in (ids["inference"], ids["rollout"], new_train):
        wait_until(lambda job=job: ended(job, "CANCELLED"), f"job {job} to be cancelled by arl stop")
    after = arl(workdir, "status", str(run_dir(workdir)))
    assert after.returncode == 0 and after.stdout.count("STOPPED") == 3, after.stdout


@pytest.mark.slurm
@slurm
def test_a_failed_slurm_stage_is_reported_with_its_log(workdir: Path) -> None:
    result = arl(workdir, "launch", "config.yaml", "--executor", "slurm", env={"FAKE_FAIL": "train"})
    assert result.returncode == 0, result.stdout + result.stderr
    train = jobs(workdir)["train"][0]["job_id"]
    wait_until(lambda: ended(train, "FAILED"), f"job {train} to fail and leave the queue")
    status = arl(workdir, "status", str(run_dir(workdir)))
    assert status.returncode == 1
    flat = " ".join(status.stdout.split())
    assert "stage train died: job" in flat and "ended FAILED on localhost" in flat
    assert "logs/train/attempt_1.log" in flat
    log = (run_dir(workdir) / "logs" / "train" / "attempt_1.log").read_text()
    assert "failing on purpose" in log and "exited with code 3" in log
    assert arl(workdir, "stop", str(run_dir(workdir))).returncode == 0


@pytest.mark.slurm
@slurm
def test_a_prepared_script_runs_with_plain_sbatch(workdir: Path) -> None:
    dry = arl(workdir, "launch", "config.yaml", "--prepare")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    script = run_dir(workdir) / "sbatch" / "train.sbatch"
    assert f"sbatch {script}" in dry.stdout and not (run_dir(workdir) / "jobs.json").exists()
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], cwd="/", capture_output=True, text=True,
                               env={**os.environ, "FAKE_TRAIN_S": "0"}, check=True)  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    wait_until(lambda: sacct_state(job) == "COMPLETED", f"plain-sbatch job {job} to complete")
    assert "train.1.done" in markers(workdir)
    log = (run_dir(workdir) / "logs" / "train" / "attempt_1.log").read_text()
    assert f"job {job}" in log and "fake train.1 running in " + str(workdir) in log


@pytest.mark.slurm
@slurm
def test_hand_submitted_prepared_jobs_record_themselves_for_status_and_stop(workdir: Path) -> None:
    """Jobs from plain `sbatch` of prepared scripts appear in `arl status` and are cancelled by `arl stop`."""
    assert arl(workdir, "launch", "config.yaml", "--prepare").returncode == 0
    env = {**os.environ, "FAKE_TRAIN_FOREVER": "1"}
    ids = {}
    for stage in ("inference", "rollout", "train"):
        script = run_dir(workdir) / "sbatch" / f"{stage}.sbatch"
        out = subprocess.run(["sbatch", "--parsable", str(script)], cwd="/", capture_output=True, text=True, env=env,
                             check=True)  # fmt: skip
        ids[stage] = out.stdout.strip().split(";")[0]
    wait_until(lambda: {f"{s}.1.started" for s in ids} <= markers(workdir), "the hand-submitted jobs to run")
    status = arl(workdir, "status", str(run_dir(workdir)))
    assert status.returncode == 0 and status.stdout.count("RUNNING") == 3, status.stdout
    assert all(f"{job}" in status.stdout for job in ids.values()), status.stdout
    assert not (run_dir(workdir) / "jobs.json").exists()  # each job wrote only its own record

    stop = arl(workdir, "stop", str(run_dir(workdir)))
    assert stop.returncode == 0, stop.stdout
    for job in ids.values():
        wait_until(lambda job=job: sacct_state(job) == "CANCELLED", f"job {job} to be cancelled by arl stop")
