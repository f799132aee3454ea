"""An inference server dies mid-request (`kill -9`): the engine client fails over, and an agent run
through the proxy either completes or is counted as failed; nothing hangs (every wait is bounded).

Two real `hf` servers run as subprocesses (the harness of `benchmarks/proxy_load.py`), so one can be
SIGKILLed by pid while it is decoding. The second test runs the real `arl stage rollout` against both.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from pipeline.engine.client import EngineClient, EngineError, GenerateResult
from pipeline.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]
LONG = {"max_new_tokens": 600, "ignore_eos": True}


def load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("proxy_load", REPO / "benchmarks" / "proxy_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["proxy_load"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def two_servers(tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    harness = load_harness()
    servers = [harness.start_engine(tiny_model_dir, tmp_path / f"engine{i}.log") for i in range(2)]
    yield servers
    for _, proc in servers:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


def busy(url: str) -> int:
    info = httpx.get(f"{url}/get_server_info", timeout=10).json()
    return int(info["running"]) + int(info["waiting"])


async def until(predicate: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_client_fails_over_when_a_server_is_killed_mid_request(two_servers: list[Any]) -> None:
    (url_a, proc_a), (url_b, _) = two_servers
    async with EngineClient([url_a, url_b], health_interval_s=0, request_timeout_s=300) as client:

        async def streamed(ids: list[int]) -> list[int]:
            out: list[int] = []
            async for chunk in client.generate_stream(ids, LONG):
                out += chunk.new_ids
            return out

        plain = [asyncio.create_task(client.generate([5, 6, i], LONG)) for i in range(2)]
        streams = [asyncio.create_task(streamed([7, 8, i])) for i in range(2)]
        await until(lambda: client.inflight() == {url_a: 2, url_b: 2})
        await until(lambda: busy(url_a) > 0)
        os.kill(proc_a.pid, signal.SIGKILL)  # our own child, by pid
        proc_a.wait(timeout=30)
        done = await asyncio.wait_for(asyncio.gather(*plain, *streams, return_exceptions=True), timeout=300)
    for result in done[:2]:  # a non-streamed request restarts on the live server and completes
        assert isinstance(result, GenerateResult), repr(result)
        assert result.server == url_b and len(result.output_ids) == LONG["max_new_tokens"]
    for result in done[2:]:  # a stream either completes (it was on B, or had no token yet) or fails clearly
        if isinstance(result, BaseException):
            assert isinstance(result, EngineError) and url_a in str(result), repr(result)
        else:
            assert isinstance(result, list) and len(result) == LONG["max_new_tokens"]


@pytest.mark.xfail(strict=True, reason="pipeline/engine/client.py EngineClient: aiohttp keeps idle connections 15 s "
                   "(TCPConnector default) but uvicorn/SGLang servers close them after 5 s; when the client's loop is "
                   "busy as the server closes one (a load spike), the next request goes out on the dead connection, "
                   "gets ServerDisconnectedError, and with one server the request fails (503 to the agent; with two it "
                   "marks a healthy server down). Seen 7x in 32 sessions of test_load.py. Fix: "
                   "TCPConnector(keepalive_timeout=~2 s) below the servers' keep-alive, and retry once on the same "
                   "server when a reused connection fails before any response byte")  # fmt: skip
async def test_a_request_after_the_servers_keep_alive_expired_is_not_lost(tiny_model_dir: Path) -> None:
    from pipeline.engine.testing import start_hf_server

    with start_hf_server(tiny_model_dir) as server:
        async with EngineClient([server.url], health_interval_s=0) as client:
            await client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
            # This loop is busy (the proxy under load) while the server's 5 s keep-alive closes the idle
            # connection; the server runs on its own thread and loop, so it does close it meanwhile.
            time.sleep(5.5)
            result = await client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
    assert len(result.output_ids) == 2


AGENT = '''
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
'''


def rollout_run(tmp_path: Path, model_dir: Path, urls: list[str]) -> RunPaths:
    from pipeline.config import dump_config, validate_config
    from pipeline.engine.registry import write_entry
    from schemas.engine_api import InferenceEntry

    (tmp_path / "agent.py").write_text(AGENT)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}", "i": i}) + "\n" for i in range(8)))
    config = validate_config({
        "fileroot": str(tmp_path / "runs"), "num_steps": 2, "model": {"path": str(model_dir)},
        "inference": {"request_timeout_s": 120},
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


@pytest.mark.slow
def test_rollout_survives_a_server_killed_mid_step(two_servers: list[Any], tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:  # fmt: skip
    (url_a, proc_a), (url_b, _) = two_servers
    paths = rollout_run(tmp_path, tiny_model_dir, [url_a, url_b])
    stage = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "stage", "rollout", "--run-dir", str(paths.root)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while busy(url_a) == 0:  # the kill must land while A is decoding for the rollout
            assert stage.poll() is None, stage.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "server A never got work"
            time.sleep(0.05)
        time.sleep(random.Random(7).uniform(0.0, 1.0))
        os.kill(proc_a.pid, signal.SIGKILL)
        out, _ = stage.communicate(timeout=400)  # never hangs: a timeout here fails the test
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
    text = out.decode(errors="replace")
    assert stage.returncode == 0, text[-4000:]
    assert paths.complete_steps() == [0, 1]
    lines = [json.loads(line) for line in paths.rollout_metrics.read_text().splitlines()]
    by_step = {line["step"]: line for line in lines}
    assert sorted(by_step) == [0, 1] and len(lines) == 2, "each step ran exactly once"
    for line in by_step.values():
        # every run is accounted for: finished into samples, or counted as an error
        assert line["runs"] == 8
        assert line["sessions"] + line["agent_errors"] + line["rejected"] + line["empty_runs"] == 8, line
    assert by_step[1]["agent_errors"] == 0, "after the kill, new runs go to the live server"
