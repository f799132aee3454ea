"""The W&B sink against real wandb in offline mode (no network): the stage's offline run, read back from its
`.wandb` file, holds the same steps and values as the JSONL rows; unset, wandb is never imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from wandb_offline import isolate_wandb, offline_runs, read_offline_run  # tests/integration is on sys.path (pytest)

from pipeline.run.config import dump_config, load_config
from pipeline.run.handoff import write_text_atomic
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl
from pipeline.run.stage import StageContext
from pipeline.trainer.metrics import open_sinks

REPO = Path(__file__).resolve().parents[2]
OFFLINE = ["metrics.wandb.mode=offline", "metrics.wandb.project=arl-test", "metrics.wandb.tags=[ci, tiny]"]


def frozen_run(tmp_path: Path, overrides: list[str]) -> RunPaths:
    config = load_config(None, [f"fileroot={tmp_path}", "experiment_name=exp", "trial_name=t1", *overrides])
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    write_text_atomic(paths.config, dump_config(config))
    return paths


@pytest.fixture(autouse=True)
def _no_wandb_outside_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_wandb(monkeypatch, tmp_path)


def test_trainer_sinks_write_each_step_to_an_offline_wandb_run(tmp_path: Path) -> None:
    paths = frozen_run(tmp_path, OFFLINE)
    ctx = StageContext.from_run_dir("train", paths.root)
    sink = open_sinks(ctx.config, paths, rank=0)
    rows = {0: {"loss": 0.5, "reward_mean": 0.25, "version": 1, "mfu": None},
            1: {"loss": 0.25, "reward_mean": 0.5, "version": 2, "lr": float("nan")},
            2: {"loss": 0.125, "reward_mean": 0.75, "version": 3}}  # fmt: skip
    for step, values in rows.items():
        sink.log(step, values)
    sink.close()

    run_id = paths.wandb_run_id("train").read_text().strip()
    (run,) = offline_runs(paths.wandb, run_id)
    assert (run.run.project, run.run.run_group, run.run.job_type) == ("arl-test", "exp/t1", "train")
    assert run.run.display_name == "exp/t1/train" and list(run.run.tags) == ["ci", "tiny"]
    assert str(paths.root) in run.run.notes
    assert run.exit_code == 0
    # The same steps as the JSONL rows; numbers under `train/`; None and NaN left out (JSONL writes null).
    assert [r["step"] for r in read_jsonl(paths.train_metrics)] == [0, 1, 2]
    assert run.history == {step: {f"train/{k}": v for k, v in values.items() if k in ("loss", "reward_mean", "version")}
                           for step, values in rows.items()}  # fmt: skip
    # Other ranks write nothing (one writer per file, one W&B run per stage).
    assert type(open_sinks(ctx.config, paths, rank=1)).__name__ == "NullSink"


def test_a_restarted_stage_continues_its_wandb_run_and_a_redo_gets_its_own(tmp_path: Path) -> None:
    from pipeline.rollout.loop import open_sink

    paths = frozen_run(tmp_path, OFFLINE)
    first = open_sink(StageContext.from_run_dir("rollout", paths.root))
    first.log(0, {"reward_mean": 0.1, "staleness_hist": {"0": 6, "1": 2}, "reward_min": None})
    first.close()
    again = open_sink(StageContext.from_run_dir("rollout", paths.root))  # `arl launch --resume`
    again.log(1, {"reward_mean": 0.2, "staleness_hist": {"0": 8}})
    again.close()
    redo = open_sink(StageContext.from_run_dir("rollout", paths.root, only_step=0))  # `arl stage rollout --step 0`
    redo.log(0, {"reward_mean": 0.3})
    redo.close()

    run_id = paths.wandb_run_id("rollout").read_text().strip()
    parts = offline_runs(paths.wandb, run_id)
    assert [p.history for p in parts] == [
        {0: {"rollout/reward_mean": 0.1, "rollout/staleness_hist/0": 6, "rollout/staleness_hist/1": 2}},
        {1: {"rollout/reward_mean": 0.2, "rollout/staleness_hist/0": 8}},
    ], "one W&B run id across both processes: `wandb sync` uploads them as one run"
    (redo_dir,) = [d for d in paths.wandb.glob("offline-run-*") if run_id not in d.name]
    redo_run = read_offline_run(redo_dir)
    assert redo_run.run.display_name == "exp/t1/rollout-redo-step0" and redo_run.run.run_group == "exp/t1"
    assert redo_run.history == {0: {"rollout/reward_mean": 0.3}}


def test_a_failing_stage_marks_its_wandb_run_failed(tmp_path: Path) -> None:
    paths = frozen_run(tmp_path, OFFLINE)
    sink = open_sinks(StageContext.from_run_dir("train", paths.root).config, paths, rank=0)
    with pytest.raises(RuntimeError):
        try:
            sink.log(0, {"loss": 1.0})
            raise RuntimeError("the step failed")
        finally:
            sink.close()
    (run,) = offline_runs(paths.wandb, paths.wandb_run_id("train").read_text().strip())
    assert run.exit_code == 1 and run.history == {0: {"train/loss": 1.0}}


def test_a_training_stage_logs_its_steps_to_wandb(make_train_run) -> None:
    """A real (tiny) trainer stage with `metrics.wandb.mode=offline` as the only change."""
    from pipeline.trainer.loop import run_trainer

    overrides = ["num_steps=2", "trainer.wait_timeout_s=5", "rollout.max_staleness=10", "metrics.wandb.mode=offline"]
    paths = make_train_run(steps=[0, 1], overrides=overrides)
    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0
    (run,) = offline_runs(paths.wandb, paths.wandb_run_id("train").read_text().strip())
    records = read_jsonl(paths.train_metrics)
    assert sorted(run.history) == [r["step"] for r in records] == [0, 1]
    for record in records:
        logged = run.history[record["step"]]
        for key in ("loss", "reward_mean", "grad_norm", "version", "tokens_per_s"):
            assert logged[f"train/{key}"] == pytest.approx(record[key]), key
    assert run.exit_code == 0 and run.run.project == "arl" and run.run.job_type == "train"


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})  # fmt: skip


def test_without_metrics_wandb_wandb_is_never_imported(tmp_path: Path) -> None:
    paths = frozen_run(tmp_path, [])
    code = f"""
import sys
from pipeline.rollout.loop import open_sink
from pipeline.run.stage import open_stage
from pipeline.trainer.metrics import open_sinks
import pipeline.trainer.loop, pipeline.rollout.external, stages.train, stages.rollout, stages.proxy
ctx = open_stage("train", {str(paths.root)!r})
for sink in (open_sinks(ctx.config, ctx.paths, 0), open_sink(ctx)):
    sink.log(0, {{"loss": 1.0}})
    sink.close()
print("wandb" in sys.modules)
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert not paths.wandb.exists()


def test_configured_but_not_installed_fails_the_stage_at_start_naming_the_extra(tmp_path: Path) -> None:
    paths = frozen_run(tmp_path, ["metrics.wandb.mode=offline"])
    hide = tmp_path / "no_wandb"
    (hide / "wandb").mkdir(parents=True)  # shadows the installed package, as if it were not there
    (hide / "wandb" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\")\n")
    command = [sys.executable, "-m", "pipeline.cli", "stage", "train", "--run-dir", str(paths.root)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(REPO)])})  # fmt: skip
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith(("20", " "))]  # not log lines
    assert errors == ["error: metrics.wandb is set but wandb is not installed here: pip install 'arl[wandb]' "
                      "(or drop metrics.wandb from the config)"], result.stderr  # fmt: skip
    assert "Traceback" not in result.stderr
    assert not paths.train_metrics.exists() and not paths.checkpoints.exists(), "it failed before any work"
