"""Run-dir paths: every docs/run-directory.md path from one place, zero-padded steps, markers, scans."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.run.paths import COMPLETE, MANIFEST, RunPaths, parse_step_name, step_name


def test_step_names_are_zero_padded_and_parse_back() -> None:
    assert step_name(12) == "step_000012"
    assert step_name(1_234_567) == "step_1234567"
    assert parse_step_name("step_000012") == 12
    assert parse_step_name(step_name(1_234_567)) == 1_234_567
    for junk in ("step_12", "step_000012.ab12cd34.tmp", "step_000012.old.tmp", "LATEST", "steps_000001"):
        assert parse_step_name(junk) is None
    with pytest.raises(ValueError, match="-1"):
        step_name(-1)
    # Lexical order is numeric order, so `ls` and sorted() agree with step order.
    names = [step_name(s) for s in (3, 10, 200, 9)]
    assert sorted(names) == [step_name(s) for s in (3, 9, 10, 200)]


def test_every_spec_path(tmp_path: Path) -> None:
    p = RunPaths.from_config(tmp_path, "exp", "trial")
    root = tmp_path / "exp" / "trial"
    assert p.root == root
    expected = {
        p.config: "config.yaml",
        p.jobs: "jobs.json",
        p.inference_entry("server0"): "registry/inference/server0.json",
        p.proxy_entry("main"): "registry/proxy/main.json",
        p.weight_sync: "registry/weight_sync.json",
        p.step_dir(12) / p.shard_name("rollout", 3): "trajectories/step_000012/part-rollout-00003.parquet",
        p.step_manifest(12): "trajectories/step_000012/_MANIFEST.json",
        p.checkpoint_dir(12): "checkpoints/step_000012",
        p.checkpoint_marker(12): "checkpoints/step_000012/_COMPLETE",
        p.latest: "checkpoints/LATEST",
        p.rollout_state: "state/rollout_cursor.json",
        p.trainer_state_dir(4): "state/trainer/step_000004",
        p.weight_version: "state/weight_version.json",
        p.rollout_metrics: "metrics/rollout.jsonl",
        p.train_metrics: "metrics/train.jsonl",
        p.tensorboard: "metrics/tb",
        p.wandb: "metrics/wandb",
        p.wandb_run_id("train"): "metrics/wandb/train.run_id",
        p.stage_log("train", 2): "logs/train/attempt_2.log",
    }
    for got, rel in expected.items():
        assert got == root / rel, rel
    assert MANIFEST == "_MANIFEST.json" and COMPLETE == "_COMPLETE"


def test_latest_log_and_next_attempt(tmp_path: Path) -> None:
    p = RunPaths(tmp_path)
    assert p.latest_log("rollout") == tmp_path / "logs/rollout/attempt_1.log"  # named before it exists
    assert p.next_attempt("rollout") == 1
    for n in (1, 2, 10):
        p.stage_log("rollout", n).parent.mkdir(parents=True, exist_ok=True)
        p.stage_log("rollout", n).write_text("")
    (p.stage_logs("rollout") / "attempt_x.log").write_text("")
    assert p.latest_log("rollout") == tmp_path / "logs/rollout/attempt_10.log"  # numeric, not lexical
    assert p.next_attempt("rollout") == 11
    assert p.next_attempt("train") == 1


def test_complete_steps_and_checkpoints_need_their_markers(tmp_path: Path) -> None:
    p = RunPaths(tmp_path)
    assert p.complete_steps() == [] and p.complete_checkpoints() == []
    for step in (2, 0, 11):
        p.step_dir(step).mkdir(parents=True)
        p.step_manifest(step).write_text("{}")
    p.step_dir(5).mkdir()  # no manifest: still being written
    (p.trajectories / "step_000007.1234abcd.tmp").mkdir()  # a staging dir
    (p.trajectories / "step_000007.1234abcd.tmp" / MANIFEST).write_text("{}")
    assert p.complete_steps() == [0, 2, 11]
    for version in (1, 3):
        p.checkpoint_dir(version).mkdir(parents=True)
    p.checkpoint_marker(3).write_text("")
    p.latest.write_text("3")
    assert p.complete_checkpoints() == [3]
