"""FSDP2 across two processes (torchrun, gloo on CPU) trains to the same weights as one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl
from pipeline.run.stage import StageContext
from pipeline.trainer.loop import run_trainer

OVERRIDES = ["num_steps=2", "trainer.minibatches=2", "trainer.micro_batch_tokens=64", "trainer.optimizer.lr=0.001",
             "rollout.max_staleness=10", "trainer.wait_timeout_s=30"]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]


def train_single_and_sharded(make_train_run: Any, overrides: list[str]) -> tuple[RunPaths, RunPaths]:
    """The same two steps trained by one process and by two FSDP2 processes (torchrun, gloo): their run dirs."""
    rows = {"num_groups": 3, "group_size": 4, "completion_lens": [5, 12, 8, 20]}
    single = make_train_run(steps=[0, 1], overrides=overrides, name="single", **rows)
    sharded = make_train_run(steps=[0, 1], overrides=overrides, name="fsdp", **rows)
    run_trainer(StageContext.from_run_dir("train", single.root))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "pipeline.cli", "stage", "train", "--run-dir", str(sharded.root)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return single, sharded


@pytest.mark.slow
def test_two_process_fsdp_update_equals_single_process(make_train_run, tiny_model_dir: Path) -> None:
    single, sharded = train_single_and_sharded(make_train_run, OVERRIDES)

    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    a = load_file(str(single.checkpoint_dir(2) / "model.safetensors"))
    b = load_file(str(sharded.checkpoint_dir(2) / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], initial[name]) or name.endswith("bias"), f"{name} did not train"
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4, msg=name)
    records = [read_jsonl(p.train_metrics)[-1] for p in (single, sharded)]
    assert records[1]["world_size"] == 2 and records[0]["world_size"] == 1
    assert records[1]["loss"] == pytest.approx(records[0]["loss"], abs=1e-5)
    assert records[1]["grad_norm"] == pytest.approx(records[0]["grad_norm"], rel=1e-4)
    assert records[1]["trained_tokens"] == records[0]["trained_tokens"]
