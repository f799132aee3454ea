"""`arl diff` as a subprocess on two run dirs: frozen configs as `arl launch` writes them, metrics as the stages
log them (JsonlSink), curves built so that the answer is known: B's reward splits from A's at step 40."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.run.config import dump_config, load_config
from pipeline.run.handoff import write_text_atomic
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import JsonlSink

REPO = Path(__file__).resolve().parents[2]
ARL = REPO / ".venv" / "bin" / "arl"
STEPS = 100
SPLIT = 40


def arl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")} | {"COLUMNS": "200"}
    return subprocess.run([str(ARL), "diff", *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def make_run(root: Path, trial: str, lr: float, seed: int, *, split: bool) -> RunPaths:
    fileroot = root / trial
    config = load_config(None, [f"fileroot={fileroot}", "experiment_name=cmp", f"trial_name={trial}",
                                f"model.path={fileroot}/tiny-model", f"trainer.optimizer.lr={lr}"])  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    write_text_atomic(paths.config, dump_config(config))
    rng = np.random.default_rng(seed)
    steps = np.arange(STEPS)
    reward = 0.6 * (1 - np.exp(-steps / 25)) + rng.normal(0, 0.03, STEPS) - np.where(split & (steps >= SPLIT), 0.15, 0)
    rollout, train = JsonlSink(paths.rollout_metrics), JsonlSink(paths.train_metrics)
    for k in range(STEPS):
        rollout.log(k, {"reward_mean": reward[k], "reward_std": 0.2, "sample_len_mean": 30 + rng.normal(0, 1),
                        "sampled_tokens": 400, "samples": 100})  # fmt: skip
        train.log(k, {"loss": rng.normal(0, 0.01), "kl_behav_k3": 0.01 + rng.normal(0, 0.001), "version": k + 1})
    evals = JsonlSink(paths.eval_metrics)
    for version in (0, 50, 100):
        evals.log(version, {"set": "held-out", "version": version, "reward_mean": 0.3 + version / 400, "pass@1": 0.1})
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunPaths, RunPaths]:
    root = tmp_path_factory.mktemp("diff")
    return make_run(root, "base", 1e-5, 1, split=False), make_run(root, "hot", 1e-4, 2, split=True)


def test_table_names_the_config_change_and_where_the_reward_split(
    runs: tuple[RunPaths, RunPaths], tmp_path: Path
) -> None:
    a, b = runs
    result = arl(str(a.root), str(b.root), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "trainer.optimizer.lr" in out and "1e-05" in out and "0.0001" in out
    # Run names and paths are identity, not configuration: model.path differs only by the fileroot.
    (identity,) = [line for line in out.splitlines() if line.startswith("identity:")]
    assert "trial_name base ≠ hot" in identity and "model.path" in identity
    assert "model.path" not in out.replace(identity, "")
    assert "first divergence: reward at step" in out
    png = tmp_path / "arl-diff-base-vs-hot.png"
    assert f"plot: {png}" in out and png.read_bytes()[:4] == b"\x89PNG"


def test_json_for_scripts(runs: tuple[RunPaths, RunPaths], tmp_path: Path) -> None:
    a, b = runs
    result = arl(str(a.root), str(b.root), "--format", "json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["config"] == [{"key": "trainer.optimizer.lr", "a": 1e-5, "b": 1e-4}]
    assert set(data["identity"]) == {"experiment_name", "trial_name", "fileroot", "model.path"}
    curves = {c["name"]: c for c in data["curves"]}
    reward = curves["reward"]
    assert reward["a"]["steps"] == list(range(STEPS)) and len(reward["b"]["values"]) == STEPS
    split = reward["divergence"]
    assert SPLIT <= split["step"] <= SPLIT + 3 * data["rule"]["window"] and split["diff"] < 0, split
    assert data["first_divergence"]["curve"] == "reward"
    for same in ("length", "loss", "kl behav k3", "sampled"):  # same distribution in both runs: within noise
        assert curves[same]["divergence"] is None, curves[same]
    held = curves["eval held-out reward_mean"]
    assert held["x"] == "version" and held["a"]["steps"] == [0, 50, 100] and "needed" in held["note"]
    assert data["plot"] is None and not list(tmp_path.iterdir())  # JSON writes a PNG only when asked
    asked = arl(str(a.root), str(b.root), "--format", "json", "--plot", "out/c.png", cwd=tmp_path)
    assert json.loads(asked.stdout)["plot"] == str(tmp_path / "out" / "c.png") and (tmp_path / "out" / "c.png").exists()


def in_process(*args: str) -> Any:
    """The same command through typer's runner: the error cases need no process of their own."""
    return CliRunner().invoke(app, ["diff", *args])


def test_a_stricter_rule_is_used(runs: tuple[RunPaths, RunPaths]) -> None:
    a, b = runs
    result = in_process(str(a.root), str(b.root), "--format", "json", "--sigmas", "1000")
    data = json.loads(result.stdout)
    assert data["rule"]["sigmas"] == 1000 and data["first_divergence"] is None


@pytest.mark.parametrize("case", ["same", "not-a-run", "missing", "bad-rule"])
def test_mistakes_are_one_line_and_exit_2(case: str, runs: tuple[RunPaths, RunPaths], tmp_path: Path) -> None:
    a, b = runs
    args = {"same": [str(a.root), str(a.root) + "/"], "not-a-run": [str(a.root), str(tmp_path)],
            "missing": [str(tmp_path / "nope"), str(b.root)],
            "bad-rule": [str(a.root), str(b.root), "--window", "1"]}[case]  # fmt: skip
    result = in_process(*args, "--no-plot")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and result.stdout == ""
    expected = {"same": "same run dir", "not-a-run": "not a run dir", "missing": "not a directory",
                "bad-rule": "window >= 2"}[case]  # fmt: skip
    assert expected in lines[0]
