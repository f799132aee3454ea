"""Weight publication against a real `hf` engine server on loopback: after the trainer publishes
version 1 (disk reload, or a gloo broadcast from a trainer subprocess), the engine's log-probs
equal a teacher-forced pass of the trainer's checkpoint, and the version is announced only then.
The broadcast follows SGLang's order (pause retract, begin, buckets, end, continue): a completion
running through it switches weights between two tokens, and a failed step leaves no server paused."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hf_process import hf_server_process  # tests/integration is on sys.path (pytest)

from pipeline.engine.client import EngineClient
from pipeline.engine.registry import write_entry
from pipeline.engine.server.hf.process import ServerHandle, start_hf_server
from pipeline.errors import ArlError
from pipeline.net.addresses import free_port
from pipeline.run.handoff import read_json
from pipeline.run.paths import RunPaths
from pipeline.run.stage import StageContext
from pipeline.trainer.loop import run_trainer
from pipeline.trainer.publish import publisher as publish
from pipeline.trainer.publish.publisher import buckets
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
    assert sync["backend"] == "gloo" and sync["world_size"] == 2 and sync["group_name"].startswith("arl-weights-")


def test_a_dead_server_is_taken_out_and_the_version_waits_for_it(make_train_run, server: ServerHandle,
                                                                  tiny_model_dir: Path) -> None:  # fmt: skip
    """By default every server that took part must verify the version: a dead one is taken out (the inference
    stage would restart it) and, when it does not come back within the deadline, nothing is announced."""
    paths = make_train_run(steps=[0], overrides=[*OVERRIDES, "trainer.weight_sync=disk", "trainer.publish_timeout_s=3"])
    dead = f"http://127.0.0.1:{free_port()}"
    register(paths, "s0", server.url, tiny_model_dir)
    register(paths, "s1", dead, tiny_model_dir)
    with pytest.raises(ArlError) as err:
        run_trainer(StageContext.from_run_dir("train", paths.root))
    assert "verified on 1 server(s), 2 needed" in str(err.value) and dead in str(err.value)
    assert not paths.weight_version.exists()
    assert read_json(paths.quarantine_entry("s1"))["url"] == dead
    assert not paths.quarantine_entry("s0").exists()
    assert httpx.get(server.url + "/server_info").json()["paused"] is not None  # never resumed on its own


def test_a_step_whose_publication_failed_is_logged_once_by_the_resumed_trainer(
    make_train_run, server: ServerHandle, tiny_model_dir: Path
) -> None:
    """The trainer stops in the publication of version 1, after its checkpoint is complete: a resume starts
    past step 0, so step 0's metrics row, held in state/, is logged by the resumed trainer, once."""
    overrides = [*OVERRIDES, "trainer.weight_sync=disk", "trainer.publish_timeout_s=3"]
    paths = make_train_run(steps=[], overrides=overrides)
    register(paths, "s0", server.url, tiny_model_dir)
    failed: list[BaseException] = []

    def train() -> None:
        try:
            run_trainer(StageContext.from_run_dir("train", paths.root))
        except BaseException as exc:
            failed.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    deadline = time.monotonic() + 120
    while not paths.weight_version.exists():  # the start publication (version 0) went through
        assert time.monotonic() < deadline and trainer.is_alive(), failed
        time.sleep(0.1)
    register(paths, "s1", f"http://127.0.0.1:{free_port()}", tiny_model_dir)  # dead: version 1 cannot verify on it
    make_train_run(steps=[0], overrides=overrides)
    trainer.join(timeout=300)
    assert failed and "verified on 1 server(s), 2 needed" in str(failed[0])
    assert paths.checkpoint_marker(1).exists() and not paths.train_metrics.exists()
    assert read_json(paths.pending_metrics)["step"] == 0

    (paths.inference_registry / "s1.json").unlink()  # what the inference stage does with a server taken out
    paths.quarantine_entry("s1").unlink()
    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0
    rows = [json.loads(line) for line in paths.train_metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and rows[0]["verify_s"] > 0 and not paths.pending_metrics.exists()
    assert read_json(paths.weight_version)["version"] == 1


def test_a_trainer_lost_right_after_its_checkpoint_leaves_the_step_row_for_the_resume(
    make_train_run, server: ServerHandle, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer stopped once version 1's checkpoint is complete, before anything else of the step (as rank 0 is
    when its peer's node dies at the barrier after the checkpoint): the resume starts past step 0, so step 0's
    row must already be held in state/, and the resumed trainer logs it, once."""
    from pipeline.trainer.loop import Trainer

    overrides = [*OVERRIDES, "trainer.weight_sync=disk"]
    paths = make_train_run(steps=[0], overrides=overrides)
    register(paths, "s0", server.url, tiny_model_dir)
    checkpoint = Trainer.maybe_checkpoint

    def lost_after_checkpoint(self: Trainer, version: int, *args: Any, **kwargs: Any) -> Any:
        checkpoint(self, version, *args, **kwargs)
        raise RuntimeError("the peer was lost at the barrier")

    monkeypatch.setattr(Trainer, "maybe_checkpoint", lost_after_checkpoint)
    with pytest.raises(RuntimeError, match="lost at the barrier"):
        run_trainer(StageContext.from_run_dir("train", paths.root))
    assert paths.checkpoint_marker(1).exists() and not paths.train_metrics.exists()
    assert read_json(paths.pending_metrics)["step"] == 0

    monkeypatch.setattr(Trainer, "maybe_checkpoint", checkpoint)
    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0
    rows = [json.loads(line) for line in paths.train_metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and not paths.pending_metrics.exists()


def test_with_min_servers_the_live_servers_go_on(make_train_run, server: ServerHandle, tiny_model_dir: Path) -> None:
    paths = make_train_run(steps=[0], overrides=[*OVERRIDES, "trainer.weight_sync=disk", "inference.min_servers=1"])
    dead = f"http://127.0.0.1:{free_port()}"
    register(paths, "s0", server.url, tiny_model_dir)
    register(paths, "s1", dead, tiny_model_dir)
    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0
    assert read_json(paths.weight_version)["version"] == 1
    taken_out = read_json(paths.quarantine_entry("s1"))
    assert taken_out["reason"].startswith(dead) and taken_out["version"] == 0  # at the trainer's start
    rows = [json.loads(line) for line in paths.train_metrics.read_text().splitlines()]
    assert rows[-1]["verify_s"] > 0 and rows[-1]["servers_recovered"] == 0  # s1 no longer took part
    check_served_equals_checkpoint(paths, server.url, tiny_model_dir)


def test_buckets_keep_order_and_size() -> None:
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 30, 5, 100, 1])}
    out = buckets(tensors, max_bytes=40 * 4)
    assert [list(b) for b in out] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]


@pytest.fixture
def server_process(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    """An `hf` server in its own process, so that this process can be the trainer (rank 0) of a real group."""
    with hf_server_process(tiny_model_dir, tmp_path / "server.log") as url:
        yield url


def broadcast_publisher(tmp_path: Path, url: str, model: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    paths = RunPaths.from_config(str(tmp_path), "publish", "broadcast")
    register(paths, "s0", url, model)
    options = publish.PublishOptions(verify_model=model, broadcast_timeout_s=60)
    return publish.make_publisher("nccl", paths, timeout_s=60, tied_embeddings=True, options=options)


def other_weights(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    from pipeline.demo.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "seed1", template="qwen", seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model_dir, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_broadcast_swaps_weights_between_two_tokens_of_a_running_completion(
    server_process: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several buckets while a completion streams: its tokens before the swap come from the old weights
    with version 0, every token after from the new weights (KV recomputed after the retract) with version 1;
    nothing in between, and the server ends unpaused with its session closed."""
    monkeypatch.setattr(publish, "BUCKET_BYTES", 256 * 1024)  # the tiny model in several buckets
    new_dir, state = other_weights(tmp_path)
    assert len(buckets(state, publish.BUCKET_BYTES)) > 2
    chunks: list[Any] = []

    async def consume() -> None:
        async with EngineClient([server_process], health_interval_s=0) as client:
            params = {"max_new_tokens": 300, "temperature": 1.0, "ignore_eos": True}
            async for chunk in client.generate_stream(PROMPT, params):
                chunks.append(chunk)

    stream = threading.Thread(target=asyncio.run, args=(consume(),))
    stream.start()
    publisher = broadcast_publisher(tmp_path, server_process, tiny_model_dir, monkeypatch)
    try:
        deadline = time.monotonic() + 60
        while len(chunks) < 3:
            assert time.monotonic() < deadline and stream.is_alive(), "the completion did not start"
            time.sleep(0.01)
        assert publisher.publish(1, None, state).servers == [server_process]
    finally:
        publisher.close()
        stream.join(timeout=120)
    ids = [t for c in chunks for t in c.new_ids]
    versions = [c.weight_version for c in chunks for _ in c.new_ids]
    logprobs = [lp for c in chunks for lp in c.new_logprobs]
    switch = versions.index(1)
    assert 0 < switch < len(ids) == 300 and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
    old_lp, new_lp = teacher_forced(tiny_model_dir, ids), teacher_forced(new_dir, ids)
    assert max(abs(a - b) for a, b in zip(logprobs[:switch], old_lp[:switch], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(logprobs[switch:], new_lp[switch:], strict=True)) < 1e-4
    info = httpx.get(server_process + "/server_info").json()
    assert info["paused"] is None and info["weight_version"] == "1"
    assert httpx.post(server_process + "/begin_weight_update", json={}).status_code == 200  # the session closed
    assert httpx.post(server_process + "/end_weight_update", json={}).status_code == 200


@pytest.mark.slow
def test_a_session_and_pause_left_by_a_dead_trainer_are_ended_by_the_next_publication(
    server_process: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer that died mid-update leaves its session open and generation paused: the next publication
    closes the session, sends and verifies the version, and only then resumes generation."""
    _, state = other_weights(tmp_path)
    publisher = broadcast_publisher(tmp_path, server_process, tiny_model_dir, monkeypatch)
    try:
        assert httpx.post(server_process + "/pause_generation", json={"mode": "retract"}).status_code == 200
        assert httpx.post(server_process + "/begin_weight_update", json={}).status_code == 200
        report = publisher.publish(1, None, state)
        assert report.servers == [server_process] and report.recovered == [] and report.verify_s > 0
        info = httpx.get(server_process + "/server_info").json()
        assert info["paused"] is None and info["weight_version"] == "1"
    finally:
        publisher.close()


def test_a_restarted_trainer_joins_a_new_group_and_close_makes_the_servers_leave(
    server_process: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer that died without closing leaves its group held by the server (torch keeps the group's name
    there); the next trainer (a resume, an `arl stage train --step N` redo) joins a group with a name of its
    own, makes the servers leave the dead trainer's group (named in registry/weight_sync.json), and its
    close() makes them leave its own."""
    from pipeline.engine.weight_group import destroy_weight_group

    _, state = other_weights(tmp_path)
    crashed = broadcast_publisher(tmp_path, server_process, tiny_model_dir, monkeypatch)
    assert crashed.publish(1, None, state).servers == [server_process]
    destroy_weight_group(crashed.transport.group.handle)  # what the trainer's death frees on its own side only
    crashed.calls.close()
    restarted = broadcast_publisher(tmp_path, server_process, tiny_model_dir, monkeypatch)
    try:
        assert restarted.publish(2, None, state).servers == [server_process]
        assert restarted.group_name != crashed.group_name
    finally:
        restarted.close()
    left = httpx.post(server_process + "/destroy_weights_update_group", json={"group_name": restarted.group_name})
    kept = httpx.post(server_process + "/destroy_weights_update_group", json={"group_name": crashed.group_name})
    assert left.status_code == 400, left.text  # close() made the server leave it already
    assert kept.status_code == 400, kept.text  # the restarted trainer made it leave the dead trainer's group
    assert httpx.get(server_process + "/model_info").json()["weight_version"] == "2"
