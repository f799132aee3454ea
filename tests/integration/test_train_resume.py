"""Exact resume after `kill -9`, and `--step N` reruns, with the real CLI in subprocesses
(`arl stage train`, deterministic CPU training: resumed weights must equal uninterrupted ones bitwise)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.run.handoff import read_json
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl
from pipeline.trainer import checkpoint as ckpt

OVERRIDES = ["num_steps=4", "trainer.deterministic=true", "trainer.keep_checkpoints=10", "trainer.minibatches=2",
             "trainer.optimizer.lr=0.003", "trainer.optimizer.schedule=cosine", "trainer.optimizer.warmup_steps=2",
             "rollout.max_staleness=10", "trainer.wait_timeout_s=30"]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]


def train_cmd(paths: RunPaths, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "stage", "train", "--run-dir", str(paths.root), *extra]


def run_train(paths: RunPaths, *extra: str) -> None:
    proc = subprocess.run(train_cmd(paths, *extra), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def weights(paths: RunPaths, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(paths.checkpoint_dir(version) / "model.safetensors"))


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def kill_when(paths: RunPaths, condition: str) -> str:
    """Start training and SIGKILL it at the first sign of `condition`; return what was seen."""
    proc = subprocess.Popen(train_cmd(paths), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            staging = [p for d in (paths.checkpoints, paths.state / "trainer") if d.exists()
                       for p in d.iterdir() if p.name.endswith(".tmp")]  # fmt: skip
            if condition == "staging" and staging:
                os.kill(proc.pid, signal.SIGKILL)
                return f"staging {[p.name for p in staging]}"
            if condition == "after_step_1" and paths.checkpoint_marker(2).exists():
                os.kill(proc.pid, signal.SIGKILL)
                return "checkpoint 2 complete"
            time.sleep(0.002)
        return "finished before the kill"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_kill_9_then_resume_equals_uninterrupted_and_step_rerun_is_exact(make_train_run) -> None:
    reference = make_train_run(steps=[0, 1, 2, 3], overrides=OVERRIDES, name="reference")
    run_train(reference)
    final = weights(reference, 4)

    for condition in ("after_step_1", "staging"):
        paths = make_train_run(steps=[], overrides=OVERRIDES, name=f"killed_{condition}")
        shutil.copytree(reference.trajectories, paths.trajectories)
        seen = kill_when(paths, condition)
        assert seen != "finished before the kill", condition
        assert not paths.checkpoint_marker(4).exists()
        run_train(paths)  # resume
        assert_bitwise_equal(weights(paths, 4), final)
        if condition == "after_step_1":  # it resumed from version 2 rather than starting over
            assert "starting from version 2" in paths.stage_log("train", 2).read_text()
            steps = [json.loads(line)["step"] for line in paths.train_metrics.read_text().splitlines()]
            # steps 0-1 were not trained again (step 1's line is lost if the kill beat its metrics write)
            assert steps.count(0) == 1 and steps.count(1) <= 1 and steps[-2:] == [2, 3]
        assert not [p for p in paths.checkpoints.iterdir() if p.name.endswith(".tmp")]

    # --step 1 on the finished reference run: version 2 is rewritten, bit for bit the same.
    version2 = weights(reference, 2)
    before = (reference.checkpoint_dir(2) / "_COMPLETE").stat().st_mtime_ns
    run_train(reference, "--step", "1")
    assert (reference.checkpoint_dir(2) / "_COMPLETE").stat().st_mtime_ns != before
    assert_bitwise_equal(weights(reference, 2), version2)
    assert reference.latest.read_text().strip() == "4"  # a rerun never moves LATEST backwards
    assert [r["step"] for r in read_jsonl(reference.train_metrics)] == [0, 1, 2, 3]


class Stopped(RuntimeError):
    """The trainer's end in the first attempt (a lost node, a failed publication)."""


def stop_step_1(monkeypatch: pytest.MonkeyPatch, state: str) -> None:
    """Make the trainer stop in step 1 once its row is in `state` (`pipeline.trainer.step_row.RowState`)."""
    from pipeline.trainer.loop import Trainer
    from pipeline.trainer.step_row import StepRow

    hold, checkpoint, publish, clear = StepRow.hold, Trainer.maybe_checkpoint, Trainer.publish, StepRow.clear

    def before_hold(row: StepRow) -> None:
        if row.step == 1:
            raise Stopped(state)
        hold(row)

    def after_checkpoint(trainer: Trainer, version: int, *args: Any, **kwargs: Any) -> Any:
        done = checkpoint(trainer, version, *args, **kwargs)
        if version == 2:
            raise Stopped(state)
        return done

    def in_publication(trainer: Trainer, version: int, *args: Any, **kwargs: Any) -> None:
        if version == 2:
            raise Stopped(state)
        publish(trainer, version, *args, **kwargs)

    def before_clear(row: StepRow) -> None:
        if row.step == 1:
            raise Stopped(state)
        clear(row)

    patch = {
        "computed": (StepRow, "hold", before_hold),
        "held": (Trainer, "maybe_checkpoint", after_checkpoint),
        "checkpointed": (Trainer, "publish", in_publication),
        "logged": (StepRow, "clear", before_clear),
    }
    monkeypatch.setattr(*patch[state])


@pytest.mark.parametrize("state", ["computed", "held", "checkpointed", "logged"])
def test_a_trainer_stopped_in_each_state_of_a_row_logs_each_step_once_after_resume(
    make_train_run, monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    """Stopped in step 1 with its row computed (not held: the resume trains step 1 again), held (checkpoint 2
    complete: a peer lost at its barrier), checkpointed (in the publication) or logged (before its file is
    removed): the resume leaves one line per step, and a held row is the one logged."""
    from pipeline.run.stage import StageContext
    from pipeline.trainer.loop import run_trainer
    from pipeline.trainer.metrics import Timings, publish_figures

    paths = make_train_run(
        steps=[0, 1], overrides=["num_steps=2", "trainer.wait_timeout_s=30", "rollout.max_staleness=10"]
    )
    with monkeypatch.context() as stopped:
        stop_step_1(stopped, state)
        with pytest.raises(Stopped):
            run_trainer(StageContext.from_run_dir("train", paths.root))
    held = read_json(paths.pending_metrics) if paths.pending_metrics.exists() else None
    assert (held is not None) == (state != "computed") and paths.checkpoint_marker(2).exists() == (state != "computed")
    if held is not None:
        assert held["step"] == 1 and (held["values"]["time_checkpoint_s"] > 0) == (state != "held")
    before = paths.train_metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in before] == ([0, 1] if state == "logged" else [0])

    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0
    after = paths.train_metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in after] == [0, 1] and not paths.pending_metrics.exists()
    assert after[0] == before[0]
    if state == "logged":
        assert after[1] == before[1]
    elif held is not None:  # logged by the resumed trainer, after its own publication of version 2
        row, publication = json.loads(after[1]), publish_figures(Timings()).keys()
        # Not trained again: the held figures, `time_checkpoint_s` included (0 when stopped before the rewrite).
        assert {k: row[k] for k in held["values"] if k not in publication} == {
            k: v for k, v in held["values"].items() if k not in publication
        }


def test_resume_point_needs_checkpoint_and_state(tmp_path: Path) -> None:
    """Leftovers of a kill at every point of the checkpoint sequence resolve to the right version."""
    paths = RunPaths(tmp_path)
    for v in (1, 2):
        staged = ckpt.stage_trainer_state(paths, v)
        ckpt.publish_state(paths, v, staged, {"next_step": v})
        ckpt.save_checkpoint(paths, v, {"w": torch.zeros(2)}, _model_dir(tmp_path))
    assert ckpt.resume_point(paths) == 2
    # killed after the state of version 3 was published, before its checkpoint
    ckpt.publish_state(paths, 3, ckpt.stage_trainer_state(paths, 3), {"next_step": 3})
    # killed while staging checkpoint 3: a temp dir is left
    (paths.checkpoints / "step_000003.abcd1234.tmp").mkdir()
    assert ckpt.resume_point(paths) == 2
    ckpt.clean_partial(paths)
    assert not (paths.checkpoints / "step_000003.abcd1234.tmp").exists()
    # a checkpoint whose state is gone is not a resume point either
    shutil.rmtree(paths.trainer_state_dir(2))
    assert ckpt.resume_point(paths) == 1


def test_rerun_of_a_pruned_version_explains_itself(make_train_run) -> None:
    from pipeline.errors import ArlError
    from pipeline.run.stage import StageContext
    from pipeline.trainer.loop import run_trainer

    paths = make_train_run(steps=[0], overrides=["num_steps=3"])
    with pytest.raises(ArlError, match="--step 2 needs version 2"):
        run_trainer(StageContext.from_run_dir("train", paths.root, only_step=2))
    with pytest.raises(ArlError, match="outside the run's steps"):
        run_trainer(StageContext.from_run_dir("train", paths.root, only_step=7))


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"tie_word_embeddings": false}')
    return model
