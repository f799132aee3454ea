"""A whole run (`arl launch --executor local`: inference, rollout and trainer stages as processes) whose
weight swap corrupts a tensor on one of two servers: the trainer's verification catches it, the inference
stage restarts that server, the run goes on, and every step is present exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pipeline.run.paths import RunPaths

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 3


def test_a_corrupted_swap_mid_run_is_recovered_and_every_step_is_present_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(json.dumps({"version": 2, "name": "model.layers.1.mlp.down_proj.weight"}))
    overrides = [f"fileroot={tmp_path / 'runs'}", "experiment_name=swap", "trial_name=t0", f"num_steps={NUM_STEPS}",
                 f"model.path={tiny_model_dir}", "rollout.batch_size=4", "rollout.group_size=4",
                 "inference.num_servers=2", "trainer.weight_sync=nccl", "trainer.broadcast_timeout_s=30"]  # fmt: skip
    env = {**os.environ, "ARL_TEST_CORRUPT_WEIGHTS": str(corrupt), "COLUMNS": "200"}
    launched = subprocess.run([sys.executable, "-m", "pipeline.cli", "launch", str(REPO / "examples" / "demo.yaml"),
                               *overrides, "--executor", "local"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=800)  # fmt: skip
    paths = RunPaths(tmp_path / "runs" / "swap" / "t0")
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]

    assert Path(f"{corrupt}.claimed").exists()  # the fault really fired, on one server
    assert paths.complete_steps() == list(range(NUM_STEPS))
    rows = [json.loads(line) for line in paths.train_metrics.read_text().splitlines()]
    assert sorted(Counter(r["step"] for r in rows).items()) == [(s, 1) for s in range(NUM_STEPS)]
    assert sum(r["servers_recovered"] for r in rows) == 1
    assert all(r["verify_s"] > 0 for r in rows)
    assert json.loads(paths.weight_version.read_text())["version"] == NUM_STEPS
    train_log = "".join(p.read_text(errors="replace") for p in paths.stage_logs("train").glob("*.log"))
    assert "taking inference server" in train_log and "probe position" in train_log
    inference_log = "".join(p.read_text(errors="replace") for p in paths.stage_logs("inference").glob("attempt_*.log"))
    assert "restarting inference server" in inference_log
