"""The inference stage: real `hf` server subprocesses, the registry, death of a server, resume, startup errors."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pipeline.engine.client import EngineClient
from pipeline.engine.inference.servers import ServerDied, initial_weights, run_inference
from pipeline.engine.registry import read_entries, urls_from_registry
from pipeline.errors import WaitTimeout
from pipeline.run.config import dump_config, load_config
from pipeline.run.handoff import write_json_atomic, write_text_atomic
from pipeline.run.paths import COMPLETE, RunPaths
from pipeline.run.stage import StageContext
from schemas.config import ArlConfig


def make_run(tmp_path: Path, model: Path, *overrides: str) -> tuple[RunPaths, ArlConfig]:
    config = load_config(
        None,
        [
            f"fileroot={tmp_path}",
            "experiment_name=x",
            "trial_name=t",
            f"model.path={model}",
            "inference.device=cpu",
            "model.max_context=256",
            *overrides,
        ],
    )
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    write_text_atomic(paths.config, dump_config(config))
    return paths, config


class StageThread:
    """`run_inference` in a thread, stopped through its event (what SIGTERM does in the real job)."""

    def __init__(self, paths: RunPaths, config: ArlConfig) -> None:
        self.stop = threading.Event()
        self.result: list[int | BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(paths, config), daemon=True)
        self.thread.start()

    def _run(self, paths: RunPaths, config: ArlConfig) -> None:
        try:
            self.result.append(run_inference(StageContext("inference", paths, config, attempt=1), stop=self.stop))
        except BaseException as exc:
            self.result.append(exc)

    def finish(self) -> int | BaseException:
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        return self.result[0]


def wait_for(predicate: Callable[[], object], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


@pytest.fixture
def two_servers(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[RunPaths, StageThread]]:
    paths, config = make_run(tmp_path, tiny_model_dir, "inference.num_servers=2")
    stage = StageThread(paths, config)
    yield paths, stage
    if stage.thread.is_alive():
        stage.finish()


@pytest.mark.slow
async def test_servers_register_serve_and_deregister(
    two_servers: tuple[RunPaths, StageThread], tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level("INFO", logger="arl")
    paths, stage = two_servers
    wait_for(lambda: len(read_entries(paths)) == 2 or stage.result)
    entries = read_entries(paths)
    assert {e.backend for e in entries.values()} == {"hf"}
    assert {e.model_path for e in entries.values()} == {str(tiny_model_dir)}
    assert all(e.weight_version == 0 and e.tp_size == 1 for e in entries.values())
    async with EngineClient(urls_from_registry(paths)) as client:
        result = await client.generate([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True})
    assert result.server in {e.url for e in entries.values()}
    # A server that dies is logged, deregistered and restarted (the other keeps serving meanwhile).
    victim_name, victim = sorted(entries.items())[0]
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: "exited with code -9" in caplog.text)
    assert f"inference server {victim_name}" in caplog.text
    wait_for(lambda: victim_name in read_entries(paths) and read_entries(paths)[victim_name].pid != victim.pid)
    assert "restarting inference server" in caplog.text and read_entries(paths)[victim_name].routable
    async with EngineClient([read_entries(paths)[victim_name].url]) as client:
        await client.generate([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True})
    assert stage.finish() == 0
    assert read_entries(paths) == {}


def test_resume_serves_the_newest_complete_checkpoint(tmp_path: Path, tiny_model_dir: Path):
    paths, config = make_run(tmp_path, tiny_model_dir)
    assert initial_weights(paths, config) == (str(tiny_model_dir), 0)
    for version in (1, 2, 3):
        shutil.copytree(tiny_model_dir, paths.checkpoint_dir(version))
    for version in (1, 2):  # version 3 has no marker: incomplete, must be ignored
        write_json_atomic(paths.checkpoint_dir(version) / COMPLETE, {"version": version})
    assert initial_weights(paths, config) == (str(paths.checkpoint_dir(2)), 2)


@pytest.mark.slow
def test_startup_failure_names_the_server_and_its_log(tmp_path: Path):
    paths, config = make_run(tmp_path, tmp_path / "no-such-model")
    with pytest.raises(ServerDied) as info:
        run_inference(StageContext("inference", paths, config, attempt=1))
    message = str(info.value)
    assert "exited with code" in message and "server-0.attempt_1.log" in message
    assert read_entries(paths) == {}


def test_startup_deadline_names_the_server(tmp_path: Path, tiny_model_dir: Path):
    paths, config = make_run(tmp_path, tiny_model_dir, "inference.startup_timeout_s=0.5")
    with pytest.raises(WaitTimeout) as info:
        run_inference(StageContext("inference", paths, config, attempt=1))
    assert "server-0.attempt_1.log" in str(info.value) and "startup_timeout_s" in str(info.value)
    assert read_entries(paths) == {}


@pytest.mark.slow
def test_cli_stage_serves_the_checkpoint_and_cleans_up_on_sigterm(tmp_path: Path, tiny_model_dir: Path):
    paths, _ = make_run(tmp_path, tiny_model_dir)
    shutil.copytree(tiny_model_dir, paths.checkpoint_dir(4))
    write_json_atomic(paths.checkpoint_marker(4), {"version": 4})
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "stage", "inference", "--run-dir", str(paths.root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: read_entries(paths) or proc.poll() is not None)
        (entry,) = read_entries(paths).values()
        assert entry.weight_version == 4 and entry.model_path == str(paths.checkpoint_dir(4))
        assert httpx.get(entry.url + "/model_info").json()["weight_version"] == "4"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert read_entries(paths) == {}
        with pytest.raises(httpx.HTTPError):
            httpx.get(entry.url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "inference servers ready" in paths.stage_log("inference", 1).read_text()


def test_a_stop_while_starting_registers_nothing_and_claims_no_readiness(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths, config = make_run(tmp_path, tiny_model_dir)
    stop = threading.Event()
    stop.set()  # SIGTERM arrived before the servers answered /health
    with caplog.at_level("INFO", logger="arl.engine.launch"):
        assert run_inference(StageContext("inference", paths, config, attempt=1), stop=stop) == 0
    assert read_entries(paths) == {}
    messages = [r.getMessage() for r in caplog.records]
    assert not any("servers ready" in m for m in messages)
    assert any("stop requested while the servers were starting" in m for m in messages)
