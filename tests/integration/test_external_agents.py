"""External agents: the standalone proxy stage (in this process) fed by `examples/external_agent.py`
running in another process with `AgentSession` / `AgentRunner`, plus failing, rejecting and
too-early sessions from this process. Real hf engine (tiny model), real proxy, real shards."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import ArlError
from pipeline.run.config import dump_config, validate_config
from pipeline.run.handoff import write_json_atomic
from pipeline.run.paths import RunPaths
from pipeline.run.stage import StageContext

REPO = Path(__file__).resolve().parents[2]
CLIENT_KEY = "ck-test-team"


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.server.hf.process import start_hf_server

    with start_hf_server(tiny_model_dir) as handle:
        yield handle.url


def make_run(tmp_path: Path, model_dir: Path, engine_url: str, **rollout: Any) -> tuple[Any, RunPaths]:
    from pipeline.engine.registry import write_entry
    from schemas.engine_api import InferenceEntry

    config = validate_config({
        "fileroot": str(tmp_path / "runs"), "num_steps": 2, "model": {"path": str(model_dir)},
        "proxy": {"client_keys": [CLIENT_KEY], "require_capacity": True, "max_tokens_limit": 16},
        "rollout": {"source": "external", "batch_size": 4, **rollout},
    })  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    write_entry(paths, "hf-0", InferenceEntry(url=engine_url, backend="hf", model_path=str(model_dir),
                                               weight_version=0, host=socket.gethostname(), pid=os.getpid(),
                                               started_at=time.time()))  # fmt: skip
    return config, paths


async def wait_until(predicate: Any, task: asyncio.Task[Any], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if task.done():
            task.result()
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def one_call(session: Any) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    await client.chat.completions.create(model="arl-policy", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4)  # fmt: skip


async def test_external_agent_process_fills_steps(tmp_path: Path, tiny_model_dir: Path, engine_url: str) -> None:
    from pipeline.client import AgentSession
    from pipeline.rollout.external import run_external
    from pipeline.run.shards import read_manifest, read_step
    from schemas.trajectory import validate_table

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, max_staleness=1)
    stage = asyncio.create_task(run_external(StageContext("proxy", paths, config)))
    await wait_until(lambda: paths.proxy_entry("external").exists(), stage)
    entry = json.loads(paths.proxy_entry("external").read_text())
    assert set(entry) == {"url", "urls", "host", "pid", "started_at"}, "the registry entry never holds a key"
    assert entry["urls"] == [entry["url"]]

    # A run that raises and one that rejects: ended cleanly, trained on never, their slots re-granted.
    with pytest.raises(RuntimeError, match="agent bug"):
        async with AgentSession(paths.root, client_key=CLIENT_KEY) as failing:
            await one_call(failing)
            raise RuntimeError("agent bug")
    assert failing.failed and "agent bug" in (failing.error or "")
    async with AgentSession(paths.root, client_key=CLIENT_KEY, group_id="rejected") as rejecting:
        await one_call(rejecting)
        rejecting.reject()

    agent = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "examples" / "external_agent.py"), str(paths.root), "--client-key", CLIENT_KEY,
        "--limit", "4", "--group-size", "2", cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(agent.communicate(), 180)
    assert agent.returncode == 0, out.decode()[-3000:]
    assert "8 runs: 8 finished, 0 failed" in out.decode()
    assert await asyncio.wait_for(stage, 60) == [0, 1]

    sessions: set[str] = set()
    for step in (0, 1):
        table = read_step(paths, step)
        validate_table(table)
        rows = table.to_pylist()
        step_sessions = {r["session_id"] for r in rows}
        assert len(step_sessions) == 4 and not sessions & step_sessions
        sessions |= step_sessions
        assert failing.session_id not in step_sessions and rejecting.session_id not in step_sessions
        assert all("dataset_index" in json.loads(r["metadata"]) for r in rows)
        manifest = read_manifest(paths, step)
        assert manifest.producer == "proxy-external" and manifest.extra["sessions"] == 4
    assert not paths.proxy_entry("external").exists()
    assert not list(paths.proxy_spool.glob("*.json")), "every spooled session was published, then removed"


async def test_external_sessions_wait_for_fresh_weights(tmp_path: Path, tiny_model_dir: Path, engine_url: str) -> None:
    """max_staleness 0: after step 0's sessions, no session is admitted until version 1 is published."""
    from pipeline.client import AgentSession
    from pipeline.rollout.external import run_external

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, max_staleness=0)
    stage = asyncio.create_task(run_external(StageContext("proxy", paths, config)))
    await wait_until(lambda: paths.proxy_entry("external").exists(), stage)

    async def run_one() -> None:
        async with AgentSession(paths.root, client_key=CLIENT_KEY) as session:
            await one_call(session)
            await session.set_reward(1.0)

    await asyncio.gather(*(run_one() for _ in range(4)))
    await wait_until(lambda: paths.step_manifest(0).exists(), stage)
    with pytest.raises(ArlError, match=r"admitted no session.*max_staleness"):
        async with AgentSession(paths.root, client_key=CLIENT_KEY, start_timeout_s=1.0):
            pass
    write_json_atomic(paths.weight_version, {"version": 1, "checkpoint": None, "published_at": time.time()})
    await asyncio.gather(*(run_one() for _ in range(4)))
    assert await asyncio.wait_for(stage, 60) == [0, 1]
    # The engine itself still serves version 0, so step 1's tokens fail the per-token check: every
    # sample is dropped and counted, none trained on silently.
    from pipeline.run.shards import read_manifest

    extra = read_manifest(paths, 1).extra
    assert extra["dropped_stale"] == 4 and extra["samples"] == 0
    assert read_manifest(paths, 0).extra["dropped_stale"] == 0


async def test_a_session_that_cannot_be_spooled_answers_503_and_stops_the_stage(tmp_path: Path, tiny_model_dir: Path,
                                                                                engine_url: str) -> None:  # fmt: skip
    """A 2xx end call promises the session is on disk; when it cannot be written, the agent is told."""
    from pipeline.client import AgentSession
    from pipeline.proxy.control import ProxyAPIError
    from pipeline.rollout.external import run_external

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, max_staleness=1)
    stage = asyncio.create_task(run_external(StageContext("proxy", paths, config)))
    await wait_until(lambda: paths.proxy_entry("external").exists(), stage)
    paths.proxy_spool.write_text("a file where the spool directory belongs")  # writes fail, as on a dead disk
    with pytest.raises(ProxyAPIError) as refused:
        async with AgentSession(paths.root, client_key=CLIENT_KEY) as session:
            await one_call(session)
            await session.set_reward(1.0)
    assert refused.value.status == 503
    assert session.session_id in refused.value.body and "could not save it" in refused.value.body
    with pytest.raises(ArlError, match="could not be exported and spooled"):
        await asyncio.wait_for(stage, 60)
    assert paths.complete_steps() == []
