"""The tool task's agents (examples/tools_agent.py) through the real pipeline: the OpenAI Agents SDK's own runner
loop and the plain-SDK loop, a real hf engine and the proxy, one rollout step each. What a multi-turn agent's
learning rests on: one concat row per episode whose loss mask is exactly the two model turns (the tool's result
and the prompts not trained), the individual export's first turn credited with the final reward through the
discount, the agent's metrics in metrics/rollout.jsonl, and `arl inspect` showing the credit per turn.

The model is the tiny one warm-started on a single episode of the task's corpus until it repeats it, so that its
calls are well-formed (a random-init model never calls a tool); decoding is greedy, so every episode is that one.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.agents.loading import load_object
from pipeline.demo.tasks import EXAMPLES, TOOLS
from pipeline.run.config import ArlConfig, dump_config, load_config
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl
from pipeline.run.stage import StageContext


@pytest.fixture(scope="module")
def episode_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """(a tiny model that repeats one corpus episode, that episode's row)."""
    from pipeline.demo.tiny_model import make_tiny_model
    from pipeline.demo.warm_start import warm_start

    folder = tmp_path_factory.mktemp("tools-model")
    row = json.loads(TOOLS.warm_corpus.read_text().splitlines()[0])
    corpus = folder / "one.jsonl"
    corpus.write_text(json.dumps(row) + "\n")
    model = make_tiny_model(folder / "model", num_layers=1)
    warm_start(model, corpus, steps=40, batch_size=2, lr=3e-3)
    return model, row


def _config(tmp_path: Path, model: Path, agent: str, *extra: str) -> tuple[ArlConfig, RunPaths]:
    config = load_config(TOOLS.config, [
        f"fileroot={tmp_path}", f"model.path={model}", "num_steps=1", "rollout.batch_size=2", "rollout.group_size=2",
        f"rollout.agent={EXAMPLES / 'tools_agent.py'}:{agent}", f"rollout.dataset.path={EXAMPLES / 'data/tools.jsonl'}",
        "rollout.temperature=0", "eval.sets=[]", "eval.at_start=false", "eval.every=null", *extra,
    ])  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    return config, paths


async def _one_step(config: ArlConfig, paths: RunPaths, model: Path) -> list[dict[str, Any]]:
    from pipeline.engine.registry import write_entry
    from pipeline.engine.server.hf.process import start_hf_server
    from pipeline.rollout.loop import run_rollout
    from pipeline.run.shards import read_step
    from schemas.engine_api import InferenceEntry
    from schemas.trajectory import validate_table

    with start_hf_server(model) as server:
        entry = InferenceEntry(url=server.url, backend="hf", model_path=str(model), weight_version=0,
                               host=socket.gethostname(), pid=os.getpid(), started_at=time.time())  # fmt: skip
        write_entry(paths, "hf-0", entry)
        assert await run_rollout(StageContext("rollout", paths, config)) == [0]
    table = read_step(paths, 0)
    validate_table(table)
    return table.to_pylist()


def _sampled_spans(row: dict[str, Any], tokenizer: Any) -> list[str]:
    spans, start = [], None
    for i, bit in enumerate([*row["loss_mask"], 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append(tokenizer.decode(row["input_ids"][start:i]))
            start = None
    return spans


@pytest.mark.parametrize("agent", ["ToolsAgent", "PlainToolsAgent"])
async def test_a_tool_episode_is_one_row_whose_mask_is_the_two_model_turns(
    tmp_path: Path, episode_model: tuple[Path, dict[str, Any]], agent: str
) -> None:
    from transformers import AutoTokenizer

    model, row = episode_model
    config, paths = _config(tmp_path, model, agent)
    rows = await _one_step(config, paths, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    expression = row["messages"][2]["tool_calls"][0]["function"]["arguments"]["expression"]
    result = load_object(f"{EXAMPLES / 'tools_agent.py'}:calculate")(expression)
    score = load_object(f"{EXAMPLES / 'tools_agent.py'}:score")
    dataset = [json.loads(line) for line in (EXAMPLES / "data" / "tools.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["num_turns"] == 2 for r in rows), "concat: one row per episode, both turns"
    for sample in rows:
        call, answer = _sampled_spans(sample, tokenizer)
        arguments = f'{{"expression": "{expression}"}}'
        assert call == f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call><|im_end|>'

        assert answer == f"The answer is {result}.<|im_end|>"
        text = tokenizer.decode(sample["input_ids"])
        assert f"<tool_response>\n{result}\n</tool_response>" in text  # in the row, not trained (not a span above)
        metadata = json.loads(sample["metadata"])
        data = dataset[metadata["dataset_index"]]
        assert sample["reward"] == pytest.approx(score(result, data["a"] + data["b"]))
        assert metadata["metrics"] == {"exact_correct": float(sample["reward"] == 1.0), "used_tool": 1.0}
        assert metadata["parsed_tool_calls"] == 1
    (metrics,) = read_jsonl(paths.rollout_metrics)
    assert metrics["agent/used_tool"] == 1.0 and metrics["turns_mean"] == 2.0 and metrics["prefix_breaks"] == 0
    assert metrics["agent/exact_correct"] == pytest.approx(sum(r["reward"] == 1.0 for r in rows) / len(rows))
    from pipeline.analysis.query.catalog import connect

    steps = (
        connect([paths.root])
        .connection.sql("SELECT step, rollout_agent_used_tool, rollout_agent_exact_correct FROM steps")
        .fetchall()
    )
    assert steps == [(0, 1.0, metrics["agent/exact_correct"])]


async def test_individual_export_credits_the_tool_call_turn_through_the_discount(
    tmp_path: Path, episode_model: tuple[Path, dict[str, Any]]
) -> None:
    model, _ = episode_model
    config, paths = _config(tmp_path, model, "ToolsAgent", "rollout.export_style=individual", "rollout.discount=0.5")
    rows = await _one_step(config, paths, model)
    assert len(rows) == 8, "individual: one row per model call"
    by_session: dict[str, list[dict[str, Any]]] = {}
    for sample in rows:
        by_session.setdefault(sample["session_id"], []).append(sample)
    for turns in by_session.values():
        first, last = sorted(turns, key=lambda r: len(r["input_ids"]))
        assert last["parent_id"] == first["sample_id"]
        assert first["reward"] == pytest.approx(0.5 * last["reward"]), "the call turn gets discount x the final reward"


async def test_inspect_shows_each_turns_credit(
    tmp_path: Path, episode_model: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.analysis.inspect import inspect_path

    model, _ = episode_model
    config, paths = _config(tmp_path, model, "ToolsAgent")
    rows = await _one_step(config, paths, model)
    assert inspect_path(paths.root, step=0, decode=True, fmt="json") == 0
    samples = json.loads(capsys.readouterr().out)["samples"]
    assert len(samples) == len(rows)
    for sample in samples:
        turns = [seg["turn"] for seg in sample["segments"] if seg["sampled"]]
        assert turns == [1, 2] and all(seg["turn"] is None for seg in sample["segments"] if not seg["sampled"])
        assert isinstance(sample["advantage"], float)
    assert inspect_path(paths.root, step=0, decode=True) == 0
    text = capsys.readouterr().out
    assert "⟨turn 1 · advantage" in text and "⟨turn 2 · advantage" in text
