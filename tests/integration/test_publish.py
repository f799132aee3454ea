"""Weight publication against a real `hf` engine server on loopback: after the trainer publishes
version 1 (disk reload, or a gloo broadcast from a trainer subprocess), the engine's log-probs
equal a teacher-forced pass of the trainer's checkpoint, and the version is announced only then."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.engine.client import EngineClient, EngineError
from pipeline.engine.net import free_port
from pipeline.engine.registry import write_entry
from pipeline.engine.server.hf import ServerHandle, start_hf_server
from pipeline.handoff import read_json
from pipeline.paths import RunPaths
from pipeline.stage import StageContext
from pipeline.trainer.loop import run_trainer
from pipeline.trainer.publish import buckets
from schemas.engine_api import InferenceEntry

OVERRIDES = ["num_steps=1", "trainer.optimizer.lr=0.01", "rollout.max_staleness=10", "trainer.wait_timeout_s=30",
             "trainer.publish_timeout_s=120"]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with start_hf_server(tiny_model_dir, seed=0) as handle:
        yield handle


def register(paths: RunPaths, name: str, url: str, model: Path) -> None:
    entry = InferenceEntry(url=url, backend="hf", model_path=str(model), weight_version=0,
                           host=socket.gethostname(), pid=os.getpid(), started_at=time.time())  # fmt: skip
    write_entry(paths, name, entry)


def engine_logprobs(url: str) -> tuple[list[int], list[float], int]:
    async def go() -> tuple[list[int], list[float], int]:
        async with EngineClient([url], health_interval_s=0) as client:
            res = await client.generate(PROMPT, {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True})
            return res.output_ids, res.output_logprobs, await client.weight_version()

    return asyncio.run(go())


def teacher_forced(model_dir: Path, output: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([PROMPT + output])).logits[0], -1)
    return [logp[len(PROMPT) - 1 + i, tok].item() for i, tok in enumerate(output)]


def check_served_equals_checkpoint(paths: RunPaths, url: str, initial: Path) -> None:
    ids, served, version = engine_logprobs(url)
    assert version == 1
    trained = teacher_forced(paths.checkpoint_dir(1), ids)
    assert max(abs(a - b) for a, b in zip(served, trained, strict=True)) < 1e-5
    old = teacher_forced(initial, ids)
    assert max(abs(a - b) for a, b in zip(served, old, strict=True)) > 1e-3  # the weights really changed
    assert read_json(paths.weight_version)["version"] == 1


def test_disk_publication_reloads_every_server(make_train_run, server: ServerHandle, tiny_model_dir: Path) -> None:
    paths = make_train_run(steps=[0], overrides=[*OVERRIDES, "trainer.weight_sync=disk"])
    register(paths, "s0", server.url, tiny_model_dir)
    run_trainer(StageContext.from_run_dir("train", paths.root))
    check_served_equals_checkpoint(paths, server.url, tiny_model_dir)
    assert read_json(paths.weight_version)["checkpoint"] == "checkpoints/step_000001"


@pytest.mark.slow
def test_gloo_broadcast_publication_from_trainer_process(make_train_run, server: ServerHandle,
                                                         tiny_model_dir: Path) -> None:  # fmt: skip
    paths = make_train_run(steps=[0], overrides=[*OVERRIDES, "trainer.weight_sync=nccl"])
    register(paths, "s0", server.url, tiny_model_dir)
    cmd = [sys.executable, "-m", "pipeline.cli", "stage", "train", "--run-dir", str(paths.root)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_served_equals_checkpoint(paths, server.url, tiny_model_dir)
    sync = read_json(paths.weight_sync)
    assert sync["backend"] == "gloo" and sync["world_size"] == 2 and sync["group_name"] == "arl-weights"


def test_failing_server_is_named_and_version_not_announced(make_train_run, server: ServerHandle,
                                                           tiny_model_dir: Path) -> None:  # fmt: skip
    paths = make_train_run(steps=[0], overrides=[*OVERRIDES, "trainer.weight_sync=disk"])
    dead = f"http://127.0.0.1:{free_port()}"
    register(paths, "s0", server.url, tiny_model_dir)
    register(paths, "s1", dead, tiny_model_dir)
    with pytest.raises(EngineError) as err:
        run_trainer(StageContext.from_run_dir("train", paths.root))
    assert dead in str(err.value) and server.url not in (err.value.server or "")
    assert not paths.weight_version.exists()
    assert paths.checkpoint_marker(1).exists()  # the checkpoint stays: a restart re-publishes it


def test_buckets_keep_order_and_size() -> None:
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 30, 5, 100, 1])}
    out = buckets(tensors, max_bytes=40 * 4)
    assert [list(b) for b in out] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
