"""The shipped rollout examples run as they are: configs parse, the tool agent produces valid shards."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from pipeline.run.config import dump_config, load_config
from pipeline.run.paths import RunPaths
from pipeline.run.stage import StageContext

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tool_agent.yaml", "external.yaml", "two_tasks.yaml", "demo.yaml", "tools.yaml"])
def test_example_configs_parse(name: str) -> None:
    config = load_config(REPO / "examples" / name)
    assert all(Path(REPO / task.dataset.path).exists() for task in config.rollout.task_list())
    assert all(Path(REPO / spec.path).exists() for spec in config.eval.sets)


def test_calculator_is_safe_and_right() -> None:
    from pipeline.agents.loading import load_object

    calculate = load_object(f"{REPO / 'examples/agents/tool_agent.py'}:calculate")
    assert calculate("(12 + 3) * 4") == "60" and calculate("7 / 2") == "3.5"
    assert calculate("__import__('os').system('true')").startswith("error")
    assert calculate("1 / 0").startswith("error")


async def test_tool_agent_example_step(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.engine.registry import write_entry
    from pipeline.engine.server.hf.process import start_hf_server
    from pipeline.rollout.loop import run_rollout
    from pipeline.run.shards import read_step
    from schemas.engine_api import InferenceEntry
    from schemas.trajectory import validate_table

    monkeypatch.chdir(REPO)  # the example names its agent and data relative to the repo root
    config = load_config(REPO / "examples" / "tool_agent.yaml", [
        f"fileroot={tmp_path}", f"model.path={tiny_model_dir}", "num_steps=1", "rollout.batch_size=2",
        "rollout.group_size=2", "rollout.agent_kwargs={max_turns: 2, max_tokens: 8}",
    ])  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    with start_hf_server(tiny_model_dir) as server:
        write_entry(paths, "hf-0", InferenceEntry(url=server.url, backend="hf", model_path=str(tiny_model_dir),
                                                   weight_version=0, host=socket.gethostname(), pid=os.getpid(),
                                                   started_at=time.time()))  # fmt: skip
        assert await run_rollout(StageContext("rollout", paths, config)) == [0]
    table = read_step(paths, 0)
    assert validate_table(table) >= 4  # 2 prompts x 2 runs, concat: at least one row per run
