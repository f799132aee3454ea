"""Upstream stages that never come: every cross-job wait ends at its deadline with an error naming
what it waited for, the upstream stage and that stage's log (docs/run-directory.md), and publishes nothing partial.

Each stage runs as a real `arl stage ...` subprocess; the inference server (where one is needed) is
a real `hf` server on loopback registered in the run dir.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.run.config import dump_config, validate_config
from pipeline.run.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]
AGENT = """
from openai import AsyncOpenAI

class OneCall:
    async def run(self, data, base_url, api_key, http_client, temperature):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": data["q"]}],
                                             max_tokens=2)
        return float(data["i"] % 2)
"""


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.server.hf.process import start_hf_server

    with start_hf_server(tiny_model_dir) as handle:
        yield handle.url


def rollout_run(tmp_path: Path, model_dir: Path, engine_url: str | None, **rollout: object) -> RunPaths:
    """A run dir with a frozen config, a one-call agent and (if `engine_url`) a registered engine."""
    from pipeline.engine.registry import write_entry
    from schemas.engine_api import InferenceEntry

    (tmp_path / "agent.py").write_text(AGENT)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"q": f"q{i}", "i": i}) + "\n" for i in range(4)))
    config = validate_config({
        "fileroot": str(tmp_path / "runs"), "num_steps": 2, "model": {"path": str(model_dir)},
        "inference": {"startup_timeout_s": 2},
        "rollout": {"agent": f"{tmp_path / 'agent.py'}:OneCall", "dataset": {"path": str(data)}, "batch_size": 1,
                    "group_size": 2, "max_staleness": 0, "wait_timeout_s": 2, **rollout},
    })  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    if engine_url is not None:
        write_entry(paths, "hf-0", InferenceEntry(url=engine_url, backend="hf", model_path=str(model_dir),
                                                   weight_version=0, host=socket.gethostname(), pid=os.getpid(),
                                                   started_at=time.time()))  # fmt: skip
    return paths


def stage(paths: RunPaths, name: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "stage", name, "--run-dir", str(paths.root)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def no_partial_steps(paths: RunPaths) -> list[str]:
    """Anything under trajectories/ that looks like a step but is not complete (temp dirs are fine)."""
    if not paths.trajectories.exists():
        return []
    return [p.name for p in paths.trajectories.iterdir()
            if not p.name.endswith(".tmp") and not (p / "_MANIFEST.json").exists()]  # fmt: skip


def test_rollout_deadline_names_the_trainer_and_its_log(tmp_path: Path, tiny_model_dir: Path, engine_url: str) -> None:
    """max_staleness 0: step 1 needs version 1, which no trainer ever publishes."""
    paths = rollout_run(tmp_path, tiny_model_dir, engine_url)
    done = stage(paths, "rollout")
    assert done.returncode != 0, done.stdout[-2000:]
    message = done.stderr
    assert "weight version >= 1" in message, message[-3000:]
    assert "train stage" in message
    assert str(paths.latest_log("train")) in message
    assert str(paths.weight_version) in message
    assert paths.complete_steps() == [0], "step 0 needed only version 0"
    assert no_partial_steps(paths) == []


def test_rollout_deadline_names_the_inference_stage(tmp_path: Path, tiny_model_dir: Path) -> None:
    paths = rollout_run(tmp_path, tiny_model_dir, None)
    done = stage(paths, "rollout")
    assert done.returncode != 0
    assert "inference stage" in done.stderr, done.stderr[-3000:]
    assert str(paths.latest_log("inference")) in done.stderr
    assert str(paths.inference_registry) in done.stderr
    assert paths.complete_steps() == []


def test_trainer_deadline_names_the_rollout_and_its_log(make_train_run) -> None:  # type: ignore[no-untyped-def]
    paths = make_train_run(steps=[0], overrides=["num_steps=2", "trainer.wait_timeout_s=2"])
    done = stage(paths, "train")
    assert done.returncode != 0, done.stdout[-2000:]
    assert "trajectories/step_000001/_MANIFEST.json" in done.stderr, done.stderr[-3000:]
    assert "rollout stage" in done.stderr
    assert str(paths.latest_log("rollout")) in done.stderr
    assert paths.complete_checkpoints()[-1] == 1, "step 0 was trained and published before the wait"
    assert not paths.checkpoint_dir(2).exists()
