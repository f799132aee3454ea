"""Weight swaps under real faults: the inference stage (two real `hf` server processes, supervised), a
publisher in this process as the trainer's rank 0 (gloo broadcast, verification on), and a client
hammering the servers throughout.

Faults: a server SIGKILLed mid-broadcast, a server SIGSTOPped mid-broadcast, a tensor corrupted on one
server's receiving side (`ARL_TEST_CORRUPT_WEIGHTS`), the trainer SIGKILLed mid-broadcast, and a
tensor sent under a wrong name or in a wrong dtype. Each ends with the version verified on every
server (or, for the trainer's own faults, not announced), and the hammering client never got an
answer from a model that was neither the old nor the new version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from test_inference_stage import StageThread, make_run, wait_for  # this directory is on sys.path (pytest)

from pipeline.engine.registry import read_entries, urls_from_registry
from pipeline.errors import ArlError
from pipeline.run.paths import RunPaths
from pipeline.trainer.publish import publisher as publish
from pipeline.trainer.publish.verify import ProbeModel
from schemas.config import ArlConfig

REPO = Path(__file__).resolve().parents[2]
HAMMER_PROMPT = [7, 21, 33, 45, 52, 61, 70, 88, 90, 101, 115, 130]
TOL = 2e-3  # fp32 on CPU (docs/reliability.md)


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.clone() for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@dataclass
class Hammer:
    """Scores one prompt on every routable server, over and over, recording (server, version, logprobs)."""

    paths: RunPaths
    samples: list[tuple[str, int, list[float]]] = field(default_factory=list)
    errors: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"input_ids": HAMMER_PROMPT, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}  # fmt: skip
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                for url in urls_from_registry(self.paths)():
                    try:
                        answer = http.post(url + "/generate", json=body).json()
                        meta = answer["meta_info"]
                        logprobs = [float(e[0]) for e in meta["input_token_logprobs"][1:]]
                        self.samples.append((url, int(meta["weight_version"]), logprobs))
                    except (httpx.HTTPError, KeyError, ValueError, TypeError):
                        self.errors += 1  # a server killed under the request: no answer at all
                time.sleep(0.05)

    def check(self, references: dict[int, list[float]]) -> None:
        """Every answer came from the version it names, and that is one of the published ones."""
        self.stop.set()
        self.thread.join(timeout=120)
        assert self.samples, "the hammer got no answer"
        for url, version, logprobs in self.samples:
            assert version in references, f"{url} answered from version {version}"
            diff = max(abs(a - b) for a, b in zip(logprobs, references[version], strict=True))
            assert diff < TOL, f"{url} answered as version {version} from other weights (|diff| {diff:.3g})"


@dataclass
class Stack:
    paths: RunPaths
    config: ArlConfig
    stage: StageThread
    corrupt: Path
    model: Path
    new: dict[str, torch.Tensor]
    """Version 1: the tiny model with other random weights."""

    def publisher(self, **options: Any) -> publish.Publisher:
        opts = publish.PublishOptions(verify_model=self.model, broadcast_timeout_s=8, **options)
        return publish.make_publisher("nccl", self.paths, 60, True, opts)

    def references(self) -> dict[int, list[float]]:
        probe = ProbeModel(self.model, tied=True)
        return {0: probe.logprobs(weights(self.model), HAMMER_PROMPT),
                1: probe.logprobs(self.new, HAMMER_PROMPT)}  # fmt: skip

    def served(self) -> dict[str, str]:
        return {
            e.url: httpx.get(e.url + "/model_info").json()["weight_version"] for e in read_entries(self.paths).values()
        }

    def pids(self) -> list[int]:
        return [e.pid for e in read_entries(self.paths).values()]


@pytest.fixture
def stack(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    from pipeline.demo.tiny_model import make_tiny_model

    corrupt = tmp_path / "corrupt.json"
    monkeypatch.setenv("ARL_TEST_CORRUPT_WEIGHTS", str(corrupt))  # inert until the test writes the file
    monkeypatch.setattr(publish, "BUCKET_BYTES", 64 * 1024)  # the tiny model in several buckets
    # The servers' own deadline for a broadcast (`--weight-group-timeout-s`) comes from trainer.broadcast_timeout_s.
    paths, config = make_run(tmp_path, tiny_model_dir, "inference.num_servers=2", "inference.max_restarts=2",
                             "trainer.broadcast_timeout_s=8")  # fmt: skip
    stage = StageThread(paths, config)
    wait_for(lambda: len(read_entries(paths)) == 2 or stage.result)
    new = weights(make_tiny_model(tmp_path / "seed1", template="qwen", seed=1))
    try:
        yield Stack(paths, config, stage, corrupt, tiny_model_dir, new)
    finally:
        for pid in [e.pid for e in read_entries(paths).values()]:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stage.finish()


def kill_at_bucket(pid: int, sig: signal.Signals, bucket: int = 1) -> Any:
    fired: list[int] = []

    def hook(version: int, index: int) -> None:
        if index == bucket and version == 1 and not fired:  # once: the resend to the others goes through
            fired.append(pid)
            os.kill(pid, sig)

    return hook


@pytest.mark.slow
def test_a_corrupted_tensor_on_one_server_is_caught_that_server_recovered_and_the_version_served(
    stack: Stack,
) -> None:
    stack.corrupt.write_text(json.dumps({"version": 1, "name": "model.layers.0.mlp.up_proj.weight"}))
    hammer = Hammer(stack.paths)
    publisher = stack.publisher()
    try:
        report = publisher.publish(1, None, stack.new)
    finally:
        publisher.close()
    hammer.check(stack.references())
    assert len(report.recovered) == 1 and sorted(report.servers) == sorted(stack.served())
    reason = next(iter(report.reasons.values()))
    assert "probe position" in reason and "server logprob" in reason and "trainer" in reason
    assert set(stack.served().values()) == {"1"}
    assert Path(str(stack.corrupt) + ".claimed").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_a_server_killed_or_stalled_mid_broadcast_ends_within_the_deadline_and_rejoins(
    stack: Stack, sig: signal.Signals
) -> None:
    victim = sorted(read_entries(stack.paths).values(), key=lambda e: e.url)[0]
    hammer = Hammer(stack.paths)
    publisher = stack.publisher(on_bucket=kill_at_bucket(victim.pid, sig))
    try:
        t0 = time.monotonic()
        report = publisher.publish(1, None, stack.new)
        elapsed = time.monotonic() - t0
    finally:
        publisher.close()
    hammer.check(stack.references())
    assert report.reasons and victim.url in report.reasons, report
    assert elapsed < 300, "the publication waited past every deadline"
    assert victim.pid not in stack.pids()  # restarted by the inference stage
    assert set(stack.served().values()) == {"1"} and len(report.servers) == 2


TRAINER = """
import os, signal, sys, json
from pathlib import Path
import torch
from pipeline.run.paths import RunPaths
from pipeline.trainer.publish import publisher as publish
from safetensors.torch import load_file
publish.BUCKET_BYTES = 64 * 1024
root, model, new = sys.argv[1:4]
state = {k: v for k, v in load_file(new).items()}
def die(version, index):
    if index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
opts = publish.PublishOptions(verify_model=Path(model), broadcast_timeout_s=8, on_bucket=die)
paths = RunPaths(Path(root))
publish.make_publisher("nccl", paths, 60, True, opts).publish(1, None, state)
"""


@pytest.mark.slow
def test_a_trainer_killed_mid_broadcast_leaves_every_server_on_the_old_weights(stack: Stack, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    new_file = tmp_path / "new.safetensors"
    save_file({k: v.contiguous() for k, v in stack.new.items()}, str(new_file))
    hammer = Hammer(stack.paths)
    proc = subprocess.run([sys.executable, "-c", TRAINER, str(stack.paths.root), str(stack.model), str(new_file)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    time.sleep(3)  # the servers' receives fail on the closed connection
    assert set(stack.served().values()) == {"0"}  # not a half-written version 1
    publisher = stack.publisher()
    try:
        old = publisher.verifier.expect(0, weights(stack.model))  # type: ignore[union-attr]
        for url in stack.served():  # still paused, and still exactly the old weights
            check = publisher.verifier.check(publisher.calls.client, url, old)  # type: ignore[union-attr]
            verdict = publisher.calls.runner.run(check, 60)
            assert verdict.ok, verdict.problem
        report = publisher.publish(1, None, stack.new)  # the next trainer's publication goes through
    finally:
        publisher.close()
    hammer.check(stack.references())
    assert len(report.servers) == 2 and not report.recovered
    assert set(stack.served().values()) == {"1"}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["name", "dtype"])
def test_a_wrong_name_or_dtype_is_caught_before_the_version_is_announced(stack: Stack, fault: str) -> None:
    def tamper(version: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"
        if fault == "name":  # two tensors of the same shape under each other's names: every check but one passes
            tensors[a], tensors[b] = tensors[b], tensors[a]
        else:  # fp32 bits announced as int32: right shape, right name, wrong numbers
            tensors[a] = tensors[a].view(torch.int32)
        return tensors

    hammer = Hammer(stack.paths)
    bad = stack.publisher(tamper=tamper)
    try:
        with pytest.raises(ArlError, match="failed verification on every server") as err:
            bad.publish(1, None, stack.new)
    finally:
        bad.close()
    assert "probe position" in str(err.value) or "weight model.layers" in str(err.value)
    assert not stack.paths.weight_version.exists()
    assert all(httpx.get(u + "/server_info").json()["paused"] is not None for u in stack.served())
    good = stack.publisher()
    try:
        report = good.publish(1, None, stack.new)
    finally:
        good.close()
    hammer.check(stack.references())
    assert len(report.servers) == 2 and set(stack.served().values()) == {"1"}
