"""`arl stage proxy` as a subprocess: `kill -9` with finished outside sessions not yet published, restart.

The engine is a real `hf` server (tiny model) in this test process; outside agents are `AgentSession`s
driving the real OpenAI SDK with `logprobs=True`, so the test knows exactly which tokens and
log-probabilities each client was given. Every session that got a successful end call before the
kill must reach the published step exactly once, with those tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.run.config import dump_config, validate_config
from pipeline.run.paths import RunPaths

ARL = str(Path(sys.executable).with_name("arl"))
CLIENT_KEY = "ck-spool-test"


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.server.hf.process import start_hf_server

    with start_hf_server(tiny_model_dir) as handle:
        yield handle.url


def _run_dir(tmp_path: Path, model_dir: Path, engine_url: str) -> RunPaths:
    from pipeline.engine.registry import write_entry
    from schemas.engine_api import InferenceEntry

    config = validate_config({
        "fileroot": str(tmp_path / "runs"), "num_steps": 1, "model": {"path": str(model_dir)},
        "proxy": {"client_keys": [CLIENT_KEY], "require_capacity": True, "max_tokens_limit": 16},
        "rollout": {"source": "external", "batch_size": 4, "max_staleness": 0},
    })  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    write_entry(paths, "hf-0", InferenceEntry(url=engine_url, backend="hf", model_path=str(model_dir),
                                               weight_version=0, host=socket.gethostname(), pid=os.getpid(),
                                               started_at=time.time()))  # fmt: skip
    return paths


def _start_stage(paths: RunPaths, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # a file, not a pipe: a killed stage's unread output must not block it
        stage = subprocess.Popen([ARL, "stage", "proxy", "--run-dir", str(paths.root)], stdout=out,
                                 stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 120
    entry = paths.proxy_entry("external")
    while True:  # the killed stage's entry stays behind: wait for this process's own
        assert stage.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the proxy stage never registered"
        if entry.exists() and json.loads(entry.read_text())["pid"] == stage.pid:
            return stage
        time.sleep(0.1)


async def _session(paths: RunPaths, index: int) -> dict[str, Any]:
    """One outside run: a chat completion with logprobs, a reward, the end call; what the client saw."""
    from openai import AsyncOpenAI

    from pipeline.client import AgentSession

    async with AgentSession(paths.root, client_key=CLIENT_KEY, group_id=f"g{index % 2}") as session:
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        reply = await client.chat.completions.create(
            model="arl-policy", messages=[{"role": "user", "content": f"count to {index}"}], max_tokens=6,
            logprobs=True,
        )  # fmt: skip
        await session.set_reward(float(index))
    assert paths.proxy_spool_entry(session.session_id).exists(), "the end call succeeded: the session is on disk"
    content = reply.choices[0].logprobs.content or []
    return {"session_id": session.session_id, "reward": float(index), "tokens": [c.token for c in content],
            "logprobs": [c.logprob for c in content]}  # fmt: skip


def _f32(values: list[float]) -> list[bytes]:
    return [struct.pack("<f", v) for v in values]


@pytest.mark.slow
def test_finished_sessions_survive_kill9_of_the_proxy_stage(tmp_path: Path, tiny_model_dir: Path,
                                                             engine_url: str) -> None:  # fmt: skip
    from pipeline.proxy.tokenize import ChatTokenizer
    from pipeline.rollout.spool import CONSUMED_KEY
    from pipeline.run.shards import read_manifest, read_step
    from schemas.trajectory import validate_table

    paths = _run_dir(tmp_path, tiny_model_dir, engine_url)
    first = _start_stage(paths, tmp_path / "first.log")
    seen = [asyncio.run(_session(paths, i)) for i in range(2)]  # fewer than batch_size: nothing published
    os.kill(first.pid, signal.SIGKILL)  # our own child, by pid
    first.wait(30)
    assert paths.complete_steps() == []
    assert sorted(p.stem for p in paths.proxy_spool.glob("*.json")) == sorted(s["session_id"] for s in seen)
    # Damage a restart must survive: a write cut short, and a file that is not a spooled session.
    (paths.proxy_spool / "0123456789abcdef.json.deadbeef.tmp").write_bytes(b'{"format": 1, "sess')
    (paths.proxy_spool / "broken.json").write_bytes(b"\x00not json")

    second_log = tmp_path / "second.log"
    second = _start_stage(paths, second_log)

    async def rest() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(_session(paths, i) for i in range(2, 4))))

    seen += asyncio.run(rest())
    assert second.wait(120) == 0, second_log.read_text()[-4000:]
    output = second_log.read_text()
    assert f"{paths.proxy_spool / 'broken.json.corrupt'}" in output, "the damaged file is reported by path"
    assert (paths.proxy_spool / "broken.json.corrupt").exists()
    assert not list(paths.proxy_spool.glob("*.json")) and not list(paths.proxy_spool.glob("*.tmp"))

    table = read_step(paths, 0)
    validate_table(table)
    rows = table.to_pylist()
    assert Counter(r["session_id"] for r in rows) == Counter(s["session_id"] for s in seen), "each session once"
    assert sorted(read_manifest(paths, 0).extra[CONSUMED_KEY]) == sorted(s["session_id"] for s in seen)
    tok = ChatTokenizer(tiny_model_dir)
    by_session = {r["session_id"]: r for r in rows}
    for client in seen:
        row = by_session[client["session_id"]]
        sampled = [i for i, m in enumerate(row["loss_mask"]) if m]
        n = len(client["tokens"])
        # The random tiny model may end at once (n == 0): then the row holds just that end token.
        assert sampled and len(sampled) - n in (0, 1), "the client saw every sampled token but a final end token"
        assert [tok.token_text(row["input_ids"][i]) for i in sampled[:n]] == client["tokens"]
        assert _f32([row["logprobs"][i] for i in sampled[:n]]) == _f32(client["logprobs"])
        assert row["reward"] == client["reward"]
