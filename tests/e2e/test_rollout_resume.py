"""`arl stage rollout` as a subprocess: kill -9 in the middle of a step, resume, and `--step N` redo; kill -9 in
the middle of an in-run evaluation, resume.

The engine is a real `hf` server (tiny model) in this test process; the stage talks to it over
loopback like a Slurm job would. The agent holds chosen runs until a file disappears, so the kill
lands while some runs of step 1 are finished (exported, in the stage's memory) and others are not.
"""

from __future__ import annotations

import json
import os
import signal
import socket
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

pytestmark = pytest.mark.slow

AGENT = """
import asyncio, os
from openai import AsyncOpenAI

class HoldingAgent:
    async def run(self, data, base_url, api_key, http_client, temperature):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        reply = await client.chat.completions.create(
            model="arl-policy", messages=[{"role": "user", "content": data["question"]}], max_tokens=4)
        hold = os.environ.get("HOLD_FILE")
        if hold and str(data["i"]) in os.environ.get("HOLD_INDICES", "").split(","):
            open(hold + ".reached", "w").close()
            while os.path.exists(hold):
                await asyncio.sleep(0.05)
        return float(data["i"] % 2)
"""
ARL = str(Path(sys.executable).with_name("arl"))


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.server.hf.process import start_hf_server

    with start_hf_server(tiny_model_dir) as handle:
        yield handle.url


def _run_dir(tmp_path: Path, model_dir: Path, engine_url: str,
             evaluation: dict[str, Any] | None = None) -> tuple[Any, RunPaths]:  # fmt: skip
    from pipeline.engine.registry import write_entry
    from schemas.engine_api import InferenceEntry

    (tmp_path / "agent.py").write_text(AGENT)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}?", "i": i}) + "\n" for i in range(5)))
    config = validate_config({
        "fileroot": str(tmp_path / "runs"), "num_steps": 3, "model": {"path": str(model_dir)},
        "rollout": {"agent": f"{tmp_path / 'agent.py'}:HoldingAgent", "dataset": {"path": str(data), "seed": 11},
                    "batch_size": 2, "group_size": 2, "max_concurrency": 4, "run_timeout_s": 120,
                    "max_staleness": 5},
        "eval": evaluation or {},
    })  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    write_entry(paths, "hf-0", InferenceEntry(url=engine_url, backend="hf", model_path=str(model_dir),
                                               weight_version=0, host=socket.gethostname(), pid=os.getpid(),
                                               started_at=time.time()))  # fmt: skip
    return config, paths


def _stage(paths: RunPaths, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    command = [ARL, "stage", "rollout", "--run-dir", str(paths.root), *args]
    env = {**os.environ, **(env or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(process: subprocess.Popen[bytes], timeout: float = 240) -> str:
    out, _ = process.communicate(timeout=timeout)
    text = out.decode(errors="replace")
    assert process.returncode == 0, text[-4000:]
    return text


def _rows(paths: RunPaths, step: int) -> list[dict[str, Any]]:
    from pipeline.run.shards import read_step
    from schemas.trajectory import validate_table

    table = read_step(paths, step)
    validate_table(table)
    return table.to_pylist()


def _positions(rows: list[dict[str, Any]]) -> Counter[int]:
    """Sessions per scheduled position (each position must have exactly group_size sessions)."""
    sessions = {r["session_id"]: json.loads(r["metadata"])["position"] for r in rows}
    return Counter(sessions.values())


def test_kill9_mid_step_then_resume_then_redo_one_step(tmp_path: Path, tiny_model_dir: Path, engine_url: str) -> None:
    from pipeline.rollout.loop import build_schedule

    config, paths = _run_dir(tmp_path, tiny_model_dir, engine_url)
    schedule = build_schedule(config)
    step1 = schedule.prompts(1)
    hold = tmp_path / "hold"
    hold.touch()
    # Hold the runs of one of step 1's prompts; the other prompt's runs finish (exported, unpublished).
    first = _stage(paths, env={"HOLD_FILE": str(hold), "HOLD_INDICES": str(step1[0].index)})
    deadline = time.monotonic() + 120
    while not Path(f"{hold}.reached").exists() or not paths.step_manifest(0).exists():
        assert first.poll() is None, first.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, "the stage never reached step 1"
        time.sleep(0.1)
    time.sleep(1.0)  # let the other prompt's runs of step 1 finish and be exported
    os.kill(first.pid, signal.SIGKILL)  # our own child, by pid
    first.wait(30)
    assert paths.complete_steps() == [0], "a killed step must not be visible"
    assert not paths.step_dir(1).exists()
    step0_manifest = paths.step_manifest(0).read_text()

    _finish(_stage(paths))
    assert paths.complete_steps() == [0, 1, 2]
    assert paths.step_manifest(0).read_text() == step0_manifest, "a complete step is never redone on resume"
    all_rows = {k: _rows(paths, k) for k in range(3)}
    ids = [r["sample_id"] for rows in all_rows.values() for r in rows]
    assert len(ids) == len(set(ids)), "no duplicated sample"
    for k, rows in all_rows.items():
        expected = {p.position for p in schedule.prompts(k)}
        assert _positions(rows) == dict.fromkeys(expected, 2), f"step {k} redone whole, from its own prompts"
        indices = {json.loads(r["metadata"])["dataset_index"] for r in rows}
        assert indices == {p.index for p in schedule.prompts(k)}

    before = {k: paths.step_manifest(k).read_text() for k in (0, 2)}
    old_ids = {r["sample_id"] for r in all_rows[1]}
    text = _finish(_stage(paths, "--step", "1"))
    assert "step 1 published" in text
    assert {k: paths.step_manifest(k).read_text() for k in (0, 2)} == before, "only step 1 is redone"
    redone = _rows(paths, 1)
    assert _positions(redone) == dict.fromkeys({p.position for p in step1}, 2)
    assert not old_ids & {r["sample_id"] for r in redone}, "the redo replaced step 1 whole"
    assert json.loads(paths.rollout_state.read_text())["last_step"] == 2


def test_kill9_mid_evaluation_then_resume_evaluates_each_version_once(tmp_path: Path, tiny_model_dir: Path,
                                                                      engine_url: str) -> None:  # fmt: skip
    """In-run evaluation of version 0 (no trainer here: the engine serves version 0 throughout). Killed while one
    of its runs is held, the stage left no record of it; the restart evaluates it whole, once; a restart after
    a kill between its shards and its metrics line restores the line and evaluates nothing. Training shards hold
    no evaluation row."""
    held_out = tmp_path / "held.jsonl"
    held_out.write_text("".join(json.dumps({"question": f"held {i}?", "i": 100 + i}) + "\n" for i in range(3)))
    evaluation = {"at_start": True, "sets": [{"name": "held", "path": str(held_out), "max_concurrency": 2}]}
    config, paths = _run_dir(tmp_path, tiny_model_dir, engine_url, evaluation)
    from pipeline.rollout.loop import build_schedule

    schedule = build_schedule(config)
    hold = tmp_path / "hold"
    hold.touch()
    first = _stage(paths, env={"HOLD_FILE": str(hold), "HOLD_INDICES": "101"})
    deadline = time.monotonic() + 120
    while not Path(f"{hold}.reached").exists():
        assert first.poll() is None, first.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, "the evaluation never reached its held run"
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGKILL)  # our own child, by pid
    first.wait(30)
    eval_dir = paths.eval_dir(0, "held")
    assert not (eval_dir / "_MANIFEST.json").exists() and not paths.eval_metrics.exists(), "nothing half-recorded"

    text = _finish(_stage(paths))
    assert "evaluation of version 0 on held" in text
    lines = [json.loads(x) for x in paths.eval_metrics.read_text().splitlines()]
    assert [(x["version"], x["set"], x["runs"], x["failed_runs"]) for x in lines] == [(0, "held", 3, 0)]
    from pipeline.run.shards import read_step_dir

    table, manifest = read_step_dir(eval_dir)
    assert table.num_rows == 3 and (manifest.weight_versions.min, manifest.weight_versions.max) == (0, 0)
    assert {json.loads(m)["eval_set"] for m in table.column("metadata").to_pylist()} == {"held"}
    assert paths.complete_steps() == [0, 1, 2]
    for k in range(3):
        rows = _rows(paths, k)
        assert len(rows) == 4 and not any("eval_set" in json.loads(r["metadata"]) for r in rows)
        assert {json.loads(r["metadata"])["position"] for r in rows} == {p.position for p in schedule.prompts(k)}

    recorded = (eval_dir / "_MANIFEST.json").read_text()
    paths.eval_metrics.write_text("")  # killed after the shards, before the line
    _finish(_stage(paths))
    assert (eval_dir / "_MANIFEST.json").read_text() == recorded, "not evaluated again"
    again = [json.loads(x) for x in paths.eval_metrics.read_text().splitlines()]
    assert [(x["version"], x["runs"]) for x in again] == [(0, 3)], "the line restored once from the shards"
