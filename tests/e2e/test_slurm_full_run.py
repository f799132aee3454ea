"""The demo config under the real local Slurm cluster: launch, cancel the trainer mid-run, resume.

Written against the run-dir contract (docs/run-directory.md), not against any stage's internals: the stages
run as Slurm jobs, every step's shards and manifest exist exactly once, checkpoints and metrics
are valid, and a resume after `scancel` of the trainer loses and duplicates nothing.
Skipped only while the stages are not in the repository yet.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Enough steps that the cancel lands mid-run: since the overhead cuts a demo step takes well under a second, and
# with 4 steps CI once saw the trainer finish between two polls.
NUM_STEPS = 20


def _skip_reason() -> str | None:
    if not (REPO / "stages" / "rollout.py").exists():
        return "stages not yet available"
    if shutil.which("sinfo") is None:
        return "Slurm commands not installed (run scripts/local_slurm.sh up)"
    probe = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or "up" not in probe.stdout:
        return "local Slurm cluster is down (scripts/local_slurm.sh up)"
    return None


pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.skipif(_skip_reason() is not None,
                                                                      reason=_skip_reason() or "")]  # fmt: skip


def arl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=timeout)  # fmt: skip


def wait_until(check: Callable[[], bool], what: str, run_dir: Path, timeout: float, poll_s: float = 1.0) -> None:
    """Poll `check`; fail at once, with the log's tail, when a stage job of the run has failed."""
    deadline = time.monotonic() + timeout
    while not check():
        for stage, entries in json.loads((run_dir / "jobs.json").read_text())["stages"].items():
            if sacct_state(entries[-1]["job_id"]) in ("FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"):
                tail = Path(entries[-1]["log"]).read_text(errors="replace")[-4000:]
                raise AssertionError(f"stage {stage} failed while waiting for {what}; its log ends:\n{tail}")
        if time.monotonic() > deadline:
            status = arl("status", str(run_dir)).stdout
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{status}")
        time.sleep(poll_s)


def sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True)
    return (out.stdout.split() or ["?"])[0]


def test_demo_under_slurm_survives_a_cancelled_trainer(tmp_path: Path, tiny_model_dir: Path) -> None:
    from pipeline.launch.launcher import finished_version
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import read_step

    # Synchronous (max_staleness 0): each step's rollout waits for the previous version, so the trainer cannot
    # run ahead and finish every step before the cancel lands (on a quiet machine it once did, and the resume
    # then rightly found nothing to relaunch).
    overrides = [f"fileroot={tmp_path / 'runs'}", "experiment_name=slurm-e2e", "trial_name=t0",
                 f"num_steps={NUM_STEPS}", f"model.path={tiny_model_dir}", "rollout.batch_size=4",
                 "rollout.group_size=4", "rollout.max_staleness=0"]  # fmt: skip
    config_path = REPO / "examples" / "demo.yaml"
    paths = RunPaths(tmp_path / "runs" / "slurm-e2e" / "t0")

    launched = arl("launch", str(config_path), *overrides, "--executor", "slurm")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    first = {stage: e[0]["job_id"] for stage, e in json.loads(paths.jobs.read_text())["stages"].items()}
    assert sorted(first) == ["inference", "rollout", "train"]

    wait_until(lambda: bool(paths.complete_checkpoints()) and paths.complete_checkpoints()[-1] >= 1,
               "the trainer's first checkpoint", paths.root, timeout=900, poll_s=0.1)  # fmt: skip
    assert finished_version(paths) < NUM_STEPS, "the trainer finished before it could be cancelled"
    subprocess.run(["scancel", first["train"]], check=True)
    wait_until(lambda: sacct_state(first["train"]) == "CANCELLED", "the trainer's cancel", paths.root, timeout=60)

    resumed = arl("launch", str(config_path), *overrides, "--executor", "slurm", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    trains = json.loads(paths.jobs.read_text())["stages"]["train"]
    assert [e["attempt"] for e in trains] == [1, 2]
    wait_until(lambda: sacct_state(trains[1]["job_id"]) in ("COMPLETED", "FAILED", "CANCELLED"),
               "the resumed trainer to finish", paths.root, timeout=1200)  # fmt: skip
    assert sacct_state(trains[1]["job_id"]) == "COMPLETED", (paths.root / trains[1]["log"]).read_text()[-3000:]

    # every step exactly once, shards valid, no sample in two steps
    assert paths.complete_steps() == list(range(NUM_STEPS))
    seen: set[str] = set()
    for step in range(NUM_STEPS):
        table = read_step(paths, step)  # verifies the manifest's sha256 of every part
        assert table.num_rows > 0 and set(table.column("step").to_pylist()) == {step}
        ids = table.column("sample_id").to_pylist()
        assert len(ids) == len(set(ids)) and not seen & set(ids)
        seen |= set(ids)
    assert paths.complete_checkpoints()[-1] == NUM_STEPS
    assert (paths.checkpoint_dir(NUM_STEPS) / "config.json").exists()
    assert paths.latest.read_text().strip() == str(NUM_STEPS)
    logged = {json.loads(line)["step"] for line in paths.train_metrics.read_text().splitlines() if line.strip()}
    assert logged == set(range(NUM_STEPS))
    assert json.loads(paths.weight_version.read_text())["version"] == NUM_STEPS
    # the demo config evaluates versions 0 and the last one during the run: each once, across the cancel
    evaluations = [json.loads(line) for line in paths.eval_metrics.read_text().splitlines()]
    assert [(e["version"], e["set"], e["runs"]) for e in evaluations] == [
        (0, "repeat-greedy", 90),
        (NUM_STEPS, "repeat-greedy", 90),
    ]

    assert arl("stop", str(paths.root)).returncode == 0
    assert arl("status", str(paths.root)).returncode == 0
