"""Partial rollouts through the whole pipeline: inference, rollout and trainer stages as real processes.

With `inference.update_mode: interrupt` a publication lands while the rollout's completions are running
(each decode step is slowed by the `ARL_TEST_DECODE_DELAY_S` hook, so the tiny model's completions are
still in flight when the trainer publishes): those completions continue under the new weights, the shards
hold rows whose sampled tokens carry two versions, and the trainer trains on them. With `wait` no row
spans versions. Then the inference stage is killed (`kill -9`, with its servers) while the trainer holds
them paused in the middle of a swap (`ARL_TEST_STALL_UPDATE_S`); a new inference stage comes up, the
trainer finishes the publication on it, and the run completes with every step exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.run.paths import RunPaths

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 4
DEMO = REPO / "examples" / "demo.yaml"


def overrides(tmp_path: Path, model: Path, name: str, mode: str) -> list[str]:
    return [f"fileroot={tmp_path / 'runs'}", f"experiment_name={name}", "trial_name=t0", f"num_steps={NUM_STEPS}",
            f"model.path={model}", "rollout.batch_size=4", "rollout.group_size=4", "rollout.max_staleness=1",
            "rollout.agent_kwargs={max_tokens: 40}", f"inference.update_mode={mode}",
            "inference.prefix_cache_mb=0"]  # fmt: skip


def sampled_versions(paths: RunPaths) -> list[list[int]]:
    """Per shard row, the versions of its sampled tokens, in order."""
    from pipeline.run.shards import read_step

    out = []
    for step in paths.complete_steps():
        for row in read_step(paths, step).to_pylist():
            out.append([v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m])
    return out


def train_rows(paths: RunPaths) -> list[dict[str, Any]]:
    return [json.loads(line) for line in paths.train_metrics.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["interrupt", "wait"])
def test_a_run_trains_on_completions_that_span_a_weight_update(tmp_path: Path, tiny_model_dir: Path,
                                                               mode: str) -> None:  # fmt: skip
    env = {**os.environ, "ARL_TEST_DECODE_DELAY_S": "0.05", "COLUMNS": "200"}
    launched = subprocess.run([sys.executable, "-m", "pipeline.cli", "launch", str(DEMO),
                               *overrides(tmp_path, tiny_model_dir, mode, mode), "--executor", "local"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=800)  # fmt: skip
    paths = RunPaths(tmp_path / "runs" / mode / "t0")
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]

    assert paths.complete_steps() == list(range(NUM_STEPS))
    rows = train_rows(paths)
    assert sorted(Counter(r["step"] for r in rows).items()) == [(s, 1) for s in range(NUM_STEPS)]
    versions = sampled_versions(paths)
    assert all(v == sorted(v) for v in versions)  # a completion only ever moves to newer weights
    spanning = [v for v in versions if len(set(v)) > 1]
    mixed = sum(r["mixed_version_samples"] for r in rows)
    if mode == "interrupt":
        assert spanning, "no completion was in flight across a publication"
        assert mixed > 0  # the trainer saw (and trained on) them
        assert all(set(v) <= {min(v), min(v) + 1} for v in spanning)  # one publication at a time
    else:  # every completion finished under the weights it started with
        assert spanning == [] and mixed == 0
    assert json.loads(paths.weight_version.read_text())["version"] == NUM_STEPS


def start_stage(name: str, paths: RunPaths, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    handle = open(log, "ab")  # noqa: SIM115 - kept by the child
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "stage", name, "--run-dir", str(paths.root)],
                            cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, env=env)  # fmt: skip


def kill_with_children(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the stage and its servers, as a Slurm job kill does (by pid, nothing else)."""
    import psutil

    victims = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    for child in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait(timeout=60)


def paused_server(paths: RunPaths) -> str | None:
    """The URL of a registered server that is paused at a version >= 1 (a publication in the middle), if any."""
    from pipeline.engine.registry import read_entries

    for entry in read_entries(paths).values():
        with contextlib.suppress(httpx.HTTPError, ValueError):
            info = httpx.get(entry.url + "/server_info", timeout=2).json()
            if info.get("paused"):
                return entry.url
    return None


def test_inference_stage_killed_during_a_paused_swap_then_the_run_resumes(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:  # fmt: skip
    from pipeline.run.config import dump_config, load_config

    config = load_config(DEMO, overrides(tmp_path, tiny_model_dir, "killswap", "interrupt"))
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    base = {**os.environ, "ARL_TEST_DECODE_DELAY_S": "0.02"}
    logs = {name: tmp_path / f"{name}.log" for name in ("inference", "rollout", "train")}
    inference = start_stage("inference", paths, logs["inference"], {**base, "ARL_TEST_STALL_UPDATE_S": "30"})
    rollout = start_stage("rollout", paths, logs["rollout"], base)
    train = start_stage("train", paths, logs["train"], base)
    procs = [inference, rollout, train]
    try:
        deadline = time.monotonic() + 300
        while paused_server(paths) is None:  # the trainer paused the servers; the update is held 30 s
            assert time.monotonic() < deadline and train.poll() is None, logs["train"].read_text()[-3000:]
            time.sleep(0.05)
        kill_with_children(inference)
        inference = start_stage("inference", paths, logs["inference"], base)  # no stall this time
        procs[0] = inference
        deadline = time.monotonic() + 500
        while train.poll() is None:
            assert time.monotonic() < deadline, logs["train"].read_text()[-3000:]
            if rollout.poll() not in (None, 0):  # it may fail while no server answers: rerun it
                rollout = procs[1] = start_stage("rollout", paths, logs["rollout"], base)
            time.sleep(0.5)
        assert train.returncode == 0, logs["train"].read_text()[-3000:]
        rollout.wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=60)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    train_log = logs["train"].read_text(errors="replace")
    assert "taking inference server" in train_log  # the publication in flight lost its server
    rows = train_rows(paths)
    assert sorted(Counter(r["step"] for r in rows).items()) == [(s, 1) for s in range(NUM_STEPS)]
    assert paths.complete_steps() == list(range(NUM_STEPS))
    assert json.loads(paths.weight_version.read_text())["version"] == NUM_STEPS
