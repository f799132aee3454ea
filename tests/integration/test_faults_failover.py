"""An inference server dies mid-request (`kill -9`): the engine client fails over, and an agent run
through the proxy either completes or is counted as failed; nothing hangs (every wait is bounded).

Two real `hf` servers run as subprocesses (the harness of `benchmarks/proxy_load.py`), so one can be
SIGKILLed by pid while it is decoding. The second test runs the real `arl stage rollout` against both.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.engine.client import EngineClient, EngineError, GenerateResult
from pipeline.run.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]
LONG = {"max_new_tokens": 600, "ignore_eos": True}


@pytest.fixture
def two_servers(tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    from benchmarks import proxy_load as harness

    servers = [harness.start_engine(tiny_model_dir, tmp_path / f"engine{i}.log") for i in range(2)]
    yield servers
    for _, proc in servers:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


def busy(url: str) -> int:
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    return int(info["running"]) + int(info["waiting"])


async def until(predicate: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@dataclass
class KillOutcome:
    killed: str
    survivor: str
    plain: list[Any]
    """Results (or exceptions) of the two non-streamed requests."""
    streams: list[Any]
    """Token lists (or exceptions) of the two streamed requests."""


async def kill_mid_request(url_a: str, proc_a: subprocess.Popen[bytes], url_b: str) -> KillOutcome:
    """2 plain + 2 streamed long requests over A and B (least-in-flight puts one of each on A); SIGKILL A."""
    async with EngineClient([url_a, url_b], health_interval_s=0, request_timeout_s=300) as client:
        received = [0, 0]

        async def streamed(i: int) -> list[int]:
            out: list[int] = []
            async for chunk in client.generate_stream([7, 8, i], LONG):
                out += chunk.new_ids
                received[i] += 1
            return out

        plain = [asyncio.create_task(client.generate([5, 6, i], LONG)) for i in range(2)]
        streams = [asyncio.create_task(streamed(i)) for i in range(2)]
        await until(lambda: client.inflight() == {url_a: 2, url_b: 2})
        await until(lambda: busy(url_a) > 0)
        # A stream fails over only until its first chunk arrives: kill once both have one, or the
        # stream on A would (rightly) be restarted on B and nothing would be cut.
        await until(lambda: min(received) > 0)
        os.kill(proc_a.pid, signal.SIGKILL)  # our own child, by pid
        proc_a.wait(timeout=30)
        done = await asyncio.wait_for(asyncio.gather(*plain, *streams, return_exceptions=True), timeout=400)
    return KillOutcome(url_a, url_b, list(done[:2]), list(done[2:]))


@pytest.fixture(scope="module")
def killed_mid_request(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KillOutcome]:
    from benchmarks import proxy_load as harness

    work = tmp_path_factory.mktemp("kill_mid_request")
    (url_a, proc_a), (url_b, proc_b) = [harness.start_engine(tiny_model_dir, work / f"engine{i}.log") for i in range(2)]
    try:
        yield asyncio.run(kill_mid_request(url_a, proc_a, url_b))
    finally:
        for proc in (proc_a, proc_b):
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=30)


def test_plain_requests_fail_over_when_a_server_is_killed_mid_request(killed_mid_request: KillOutcome) -> None:
    for result in killed_mid_request.plain:  # restarted on the live server, complete
        assert isinstance(result, GenerateResult), repr(result)
        assert result.server == killed_mid_request.survivor and len(result.output_ids) == LONG["max_new_tokens"]
    finished = [r for r in killed_mid_request.streams if not isinstance(r, BaseException)]
    assert finished and all(len(r) == LONG["max_new_tokens"] for r in finished), "the stream on B completes"


def test_a_stream_cut_by_a_server_kill_fails_with_an_engine_error(killed_mid_request: KillOutcome) -> None:
    failed = [r for r in killed_mid_request.streams if isinstance(r, BaseException)]
    assert failed, "the stream on A was cut mid-way"
    for error in failed:
        assert isinstance(error, EngineError) and killed_mid_request.killed in str(error), repr(error)


async def test_a_request_after_the_servers_keep_alive_expired_is_not_lost(tiny_model_dir: Path) -> None:
    from pipeline.engine.server.hf.process import start_hf_server

    with start_hf_server(tiny_model_dir) as server:
        async with EngineClient([server.url], health_interval_s=0) as client:
            await client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
            # This loop is busy (the proxy under load) while the server's 5 s keep-alive closes the idle
            # connection; the server runs on its own thread and loop, so it does close it meanwhile.
            time.sleep(5.5)
            result = await client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
    assert len(result.output_ids) == 2


AGENT = """
from openai import AsyncOpenAI

class LongCall:
    async def run(self, data, base_url, api_key, http_client, temperature):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        messages = [{"role": "user", "content": data["q"]}]
        if data["i"] % 2:
            stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=300, stream=True)
            async for _ in stream:
                pass
        else:
            await client.chat.completions.create(model="m", messages=messages, max_tokens=300)
        return float(data["i"] % 3)
"""


def rollout_run(tmp_path: Path, model_dir: Path, urls: list[str], num_servers: int = 1) -> RunPaths:
    """A rollout run dir; `urls` are registered by hand (no inference stage) when given."""
    from pipeline.engine.registry import write_entry
    from pipeline.run.config import dump_config, validate_config
    from schemas.engine_api import InferenceEntry

    (tmp_path / "agent.py").write_text(AGENT)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}", "i": i}) + "\n" for i in range(8)))
    config = validate_config({
        "fileroot": str(tmp_path / "runs"), "num_steps": 2, "model": {"path": str(model_dir)},
        "inference": {"backend": "hf", "device": "cpu", "num_servers": num_servers, "request_timeout_s": 120},
        "rollout": {"agent": f"{tmp_path / 'agent.py'}:LongCall", "dataset": {"path": str(data)}, "batch_size": 4,
                    "group_size": 2, "max_staleness": 5, "max_error_rate": 1.0, "run_timeout_s": 180,
                    "export_style": "individual"},
    })  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    for i, url in enumerate(urls):
        write_entry(paths, f"hf-{i}", InferenceEntry(url=url, backend="hf", model_path=str(model_dir), weight_version=0,
                                                     host=socket.gethostname(), pid=os.getpid(),
                                                     started_at=time.time()))  # fmt: skip
    return paths


def stage(name: str, paths: RunPaths, out: Any = subprocess.PIPE) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "stage", name, "--run-dir", str(paths.root)],
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def registered_urls(paths: RunPaths) -> list[str]:
    return sorted(json.loads(p.read_text())["url"] for p in paths.inference_registry.glob("*.json"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_rollout_survives_a_server_killed_mid_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The real inference stage runs two servers; one server process is SIGKILLed while it decodes
    for the rollout. Its supervisor deregisters it; the rollout's runs on it fail over or are
    counted as errors; the stage finishes every step exactly once and never hangs."""
    import psutil

    paths = rollout_run(tmp_path, tiny_model_dir, [], num_servers=2)
    inference = stage("inference", paths, open(tmp_path / "inference.log", "ab"))  # noqa: SIM115
    rollout = None
    try:
        deadline = time.monotonic() + 300
        while len(registered_urls(paths)) < 2:
            assert inference.poll() is None and time.monotonic() < deadline, (tmp_path / "inference.log").read_text()
            time.sleep(0.2)
        url_a = registered_urls(paths)[0]
        port_a = int(url_a.rsplit(":", 1)[1])
        server_a = next(p for p in psutil.Process(inference.pid).children(recursive=True) if str(port_a) in p.cmdline())
        rollout = stage("rollout", paths)
        while busy(url_a) == 0:  # the kill must land while A is decoding for the rollout
            assert rollout.poll() is None, rollout.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline + 240, "server A never got work"
            time.sleep(0.05)
        time.sleep(random.Random(7).uniform(0.0, 1.0))
        server_a.kill()  # SIGKILL, by pid (a child of our child)
        out, _ = rollout.communicate(timeout=400)  # never hangs: a timeout here fails the test
    finally:
        if rollout is not None and rollout.poll() is None:
            rollout.kill()
            rollout.wait(timeout=60)
        inference.send_signal(signal.SIGTERM)  # it deregisters and stops its servers
        inference.wait(timeout=60)
    text = out.decode(errors="replace")
    assert rollout is not None and rollout.returncode == 0, text[-4000:]
    assert paths.complete_steps() == [0, 1]
    lines = [json.loads(line) for line in paths.rollout_metrics.read_text().splitlines()]
    by_step = {line["step"]: line for line in lines}
    assert sorted(by_step) == [0, 1] and len(lines) == 2, "each step ran exactly once"
    for line in by_step.values():
        # every run is accounted for: finished into samples, or counted as an error
        assert line["runs"] == 8
        assert line["sessions"] + line["agent_errors"] + line["rejected"] + line["empty_runs"] == 8, line


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_stale_registry_entry_does_not_stop_the_rollout(two_servers: list[Any], tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:  # fmt: skip
    (url_live, _), (url_dead, proc_dead) = two_servers
    os.kill(proc_dead.pid, signal.SIGKILL)  # a server gone without deregistering (its job was killed)
    proc_dead.wait(timeout=30)
    paths = rollout_run(tmp_path, tiny_model_dir, [url_live, url_dead])
    rollout = stage("rollout", paths)
    out, _ = rollout.communicate(timeout=400)
    assert rollout.returncode == 0, out.decode(errors="replace")[-3000:]
    assert paths.complete_steps() == [0, 1]
