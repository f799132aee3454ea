"""The rollout loop against its real neighbours: a real `hf` engine (tiny model), the real proxy in
process, real OpenAI/Anthropic SDK agents (inline and in worker processes), real Parquet shards."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.run.config import dump_config, validate_config
from pipeline.run.handoff import write_json_atomic
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl
from pipeline.run.stage import StageContext
from schemas.config import ArlConfig
from schemas.trajectory import validate_table

# Agents under test, written to a file so that the subproc workers import them by path like a user's.
AGENTS = '''
import asyncio, os
from openai import AsyncOpenAI, OpenAI

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]


def tool_turn(messages, choice):
    """Append the assistant message exactly as returned, then a tool result (the tiny random model
    rarely emits a real call; the result then answers a synthetic call id)."""
    calls = choice.message.tool_calls or []
    call_id = calls[0].id if calls else "call_0"
    return [*messages, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call_id, "content": "4"}]


class InlineToolAgent:
    def __init__(self, max_tokens=6):
        self.max_tokens = max_tokens

    async def run(self, data, base_url, api_key, http_client, temperature):
        if data.get("boom"):
            raise RuntimeError("agent exploded on purpose")
        if data.get("reject"):
            return None
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        messages = [{"role": "user", "content": data["question"]}]
        first = await client.chat.completions.create(model="arl-policy", messages=messages, tools=TOOLS,
                                                     max_tokens=self.max_tokens, temperature=temperature)
        messages = tool_turn(messages, first.choices[0])
        second = await client.chat.completions.create(model="arl-policy", messages=messages, tools=TOOLS,
                                                      max_tokens=self.max_tokens, temperature=temperature)
        return float(len(second.choices[0].message.content or "") % 3)


class SyncEnvAgent:
    """Subproc: a sync agent that only knows the environment (OPENAI_BASE_URL / OPENAI_API_KEY)."""

    def run(self, data, **kwargs):
        client = OpenAI()
        messages = [{"role": "user", "content": data["question"]}]
        first = client.chat.completions.create(model="arl-policy", messages=messages, tools=TOOLS, max_tokens=6)
        messages = tool_turn(messages, first.choices[0])
        second = client.chat.completions.create(model="arl-policy", messages=messages, tools=TOOLS, max_tokens=6)
        return {first.id: 0.25, second.id: float(data["i"] % 2)}, {"odd": data["i"] % 2 == 1, "i": data["i"]}


class AnthropicWorkflow:
    """RolloutWorkflow shape, Anthropic Messages API through the engine's client."""

    async def arun_episode(self, engine, data):
        reply = await engine.anthropic_client.messages.create(
            model="arl-policy", max_tokens=6, messages=[{"role": "user", "content": data["question"]}])
        await engine.set_reward(0.5)
        return {}


class AlwaysFails:
    async def run(self, data, **kwargs):
        raise KeyError("no such field in " + str(sorted(data)))


class NeverCalls:
    """Returns a reward without calling the model (forgot the client, or called elsewhere)."""

    async def run(self, data, **kwargs):
        return 1.0


class SwallowsItsError:
    """Its one call is refused (a temperature the proxy rejects) and it swallows the exception."""

    async def run(self, data, base_url, api_key, **kwargs):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            await client.chat.completions.create(model="arl-policy", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=-1)
        except Exception:
            pass
        return 0.0


class SlowAgent:
    async def run(self, data, **kwargs):
        client = AsyncOpenAI(base_url=kwargs["base_url"], api_key=kwargs["api_key"])
        await client.chat.completions.create(model="arl-policy", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4)
        await asyncio.sleep(float(os.environ.get("ARL_TEST_AGENT_SLEEP", "0")))
        return 1.0
'''


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.server.hf.process import start_hf_server

    with start_hf_server(tiny_model_dir) as handle:
        yield handle.url


def make_run(tmp_path: Path, model_dir: Path, engine_url: str, agent: str,
             **rollout: Any) -> tuple[ArlConfig, RunPaths]:  # fmt: skip
    """A run dir with a frozen config, a dataset, the agents file and the engine's registry entry."""
    from pipeline.engine.registry import write_entry
    from schemas.engine_api import InferenceEntry

    agents = tmp_path / "agents.py"
    agents.write_text(AGENTS)
    data = tmp_path / "data.jsonl"
    rows = rollout.pop("rows", None) or [{"question": f"What is {i} + {i}?", "i": i} for i in range(6)]
    # history: sampled, because the random tiny model samples what its template would not write back (a special
    # token the reply's content leaves out): under the default `template` such a run splits into two rows, by
    # design (tests/unit/test_template_matrix.py), and these tests check the rollout stage, not the template.
    proxy = {"default_max_tokens": 8, "history": "sampled", **rollout.pop("proxy", {})}
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {
        "fileroot": str(tmp_path / "runs"), "num_steps": rollout.pop("num_steps", 2),
        "model": {"path": str(model_dir)},
        "proxy": proxy,
        "rollout": {"agent": f"{agents}:{agent}", "dataset": {"path": str(data), "seed": 3},
                    "batch_size": 2, "group_size": 2, "max_concurrency": 4, "run_timeout_s": 60,
                    "wait_timeout_s": 30, **rollout},
    }  # fmt: skip
    config = validate_config(raw)
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    write_entry(paths, "hf-0", InferenceEntry(url=engine_url, backend="hf", model_path=str(model_dir),
                                               weight_version=0, host=socket.gethostname(), pid=os.getpid(),
                                               started_at=time.time()))  # fmt: skip
    return config, paths


def read_rows(paths: RunPaths, step: int) -> list[dict[str, Any]]:
    from pipeline.run.shards import read_step

    table = read_step(paths, step)
    validate_table(table, where=f"step {step}")
    return table.to_pylist()


async def test_metrics_wandb_offline_puts_the_reward_curve_in_the_stages_wandb_run(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`metrics.wandb.mode=offline` is the only change: the rows of metrics/rollout.jsonl land in the rollout's
    W&B run (under the run dir, read back from its `.wandb` file) at the same steps."""
    from wandb_offline import isolate_wandb, offline_runs  # tests/integration is on sys.path (pytest)

    from pipeline.rollout.loop import run_rollout

    isolate_wandb(monkeypatch, tmp_path)
    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, "InlineToolAgent")
    config = validate_config({**config.model_dump(mode="json"), "metrics": {"wandb": {"mode": "offline"}}})
    paths.config.write_text(dump_config(config))
    assert await run_rollout(StageContext("rollout", paths, config)) == [0, 1]

    (run,) = offline_runs(paths.wandb, paths.wandb_run_id("rollout").read_text().strip())
    rewards = {m["step"]: m["reward_mean"] for m in read_jsonl(paths.rollout_metrics)}
    assert {step: logged["rollout/reward_mean"] for step, logged in run.history.items()} == rewards
    assert sorted(rewards) == [0, 1] and run.exit_code == 0
    assert (run.run.job_type, run.run.run_group) == ("rollout", f"{config.experiment_name}/{config.trial_name}")


@pytest.mark.parametrize("transport", ["in_process", "http", "pool"])
async def test_inline_tool_agent_produces_valid_shards(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    from pipeline.rollout.loop import build_schedule, run_rollout

    rows_in = [{"question": f"What is {i} + {i}?", "i": i} for i in range(6)]
    rows_in[1]["reject"] = True
    rows_in[4]["boom"] = True
    # "pool": two proxy worker processes (proxy.workers), each run's session on one of them, reached over TCP.
    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, "InlineToolAgent", rows=rows_in,
                             agent_kwargs={"max_tokens": 5}, max_error_rate=0.5,
                             agent_transport="http" if transport == "pool" else transport,
                             proxy={"workers": 2} if transport == "pool" else {})  # fmt: skip
    caplog.set_level(logging.INFO, logger="arl")
    assert await run_rollout(StageContext("rollout", paths, config)) == [0, 1]
    peers = [m for m in (r.getMessage() for r in caplog.records) if "first request from" in m and "proxy" in m]
    # Over TCP the proxy sees the agents' address; handed over in process there is no peer at all (a pool's
    # workers log theirs in their own processes).
    assert bool(peers) == (transport == "http"), peers
    if transport == "pool":
        sessions = {r["session_id"] for step in (0, 1) for r in read_rows(paths, step)}
        assert {s[:2] for s in sessions} == {"00", "01"}, "the runs' sessions were spread over both workers"

    schedule = build_schedule(config)
    for step in (0, 1):
        rows = read_rows(paths, step)
        expected = [p.index for p in schedule.prompts(step)]
        meta = [json.loads(r["metadata"]) for r in rows]
        assert {m["dataset_index"] for m in meta} <= set(expected)
        assert all(m["step"] == step for m in meta) and all(r["step"] == step for r in rows)
        assert all(r["num_turns"] == 2 for r in rows), "concat export merges the two turns of a run into one row"
        assert len({r["sample_id"] for r in rows}) == len(rows)
        bad = [m for m in meta if rows_in[m["dataset_index"]].get("reject") or rows_in[m["dataset_index"]].get("boom")]
        assert not bad, "rejected and failed runs yield no samples"
        for row in rows:
            assert row["reward"] in (0.0, 1.0, 2.0)
            assert min(v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m) == 0

    metrics = read_jsonl(paths.rollout_metrics)
    assert [m["step"] for m in metrics] == [0, 1]
    scheduled = [p.index for k in (0, 1) for p in schedule.prompts(k)]
    assert sum(m["rejected"] for m in metrics) == 2 * scheduled.count(1)
    assert sum(m["agent_errors"] for m in metrics) == 2 * scheduled.count(4)
    assert all(m["runs"] == 4 and "staleness_hist" in m and "runs_per_s" in m for m in metrics)
    cursor = json.loads(paths.rollout_state.read_text())
    assert cursor["last_step"] == 1 and cursor["next_position"] == 4
    assert not paths.proxy_entry("rollout").exists(), "the registry entry goes away with the proxy"
    assert await run_rollout(StageContext("rollout", paths, config)) == [], "a finished run has nothing left to do"


async def test_subproc_sync_agent_with_env_and_dict_rewards(tmp_path: Path, tiny_model_dir: Path,
                                                            engine_url: str) -> None:  # fmt: skip
    from pipeline.rollout.loop import run_rollout

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, "SyncEnvAgent", mode="subproc",
                             subproc_workers=2, num_steps=1, export_style="individual")  # fmt: skip
    await run_rollout(StageContext("rollout", paths, config))
    rows = read_rows(paths, 0)
    assert len(rows) == 8 and all(r["num_turns"] == 1 for r in rows)  # individual: one row per LLM call
    by_session: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row)
    assert len(by_session) == 4
    for session_rows in by_session.values():
        first, second = sorted(session_rows, key=lambda r: r["parent_id"] is not None)
        index = json.loads(first["metadata"])["dataset_index"]
        assert second["parent_id"] == first["sample_id"]
        assert second["reward"] == pytest.approx(index % 2)  # the dict return, by completion id
        assert first["reward"] == pytest.approx(0.25 + index % 2)  # own + discount 1.0 x child
        # the pair return's agent metrics: in every sample of the run, and averaged in the step's metrics line
        for row in session_rows:
            assert json.loads(row["metadata"])["metrics"] == {"odd": float(index % 2), "i": float(index)}
    metrics = read_jsonl(paths.rollout_metrics)[0]
    indices = [json.loads(r["metadata"])["metrics"]["i"] for r in rows if r["parent_id"] is None]
    assert metrics["agent/i"] == pytest.approx(sum(indices) / len(indices))
    assert metrics["agent/odd"] == pytest.approx(sum(i % 2 for i in indices) / len(indices))
    # the rollout's half of the step timeline (subproc workers: start-up includes handing the run to a worker)
    parts = ["time_wait_weights_s", "time_runs_s", "time_write_s"]
    assert all(metrics[k] >= 0 for k in parts) and sum(metrics[k] for k in parts) <= metrics["time_step_s"]
    assert 0 < metrics["time_agent_start_s"] < metrics["time_runs_s"]
    assert metrics["cpu_s"] > 0, "the step's CPU time: the proxy's work at least"


async def test_anthropic_workflow_agent(tmp_path: Path, tiny_model_dir: Path, engine_url: str) -> None:
    from pipeline.rollout.loop import run_rollout

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, "AnthropicWorkflow", num_steps=1)
    await run_rollout(StageContext("rollout", paths, config))
    rows = read_rows(paths, 0)
    assert len(rows) == 4 and all(r["reward"] == pytest.approx(0.5) for r in rows)


async def test_staleness_gate_blocks_until_the_version_arrives(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Step 1 with max_staleness 0 needs version 1 from both the trainer's file and the engines."""
    import httpx

    from pipeline.engine.server.hf.process import start_hf_server
    from pipeline.rollout.loop import run_rollout

    with start_hf_server(tiny_model_dir) as server:
        config, paths = make_run(tmp_path, tiny_model_dir, server.url, "SlowAgent", max_staleness=0, num_steps=2,
                                 wait_timeout_s=120)  # fmt: skip
        task = asyncio.create_task(run_rollout(StageContext("rollout", paths, config)))
        deadline = time.monotonic() + 60
        while not paths.step_manifest(0).exists():
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.1)
        write_json_atomic(paths.weight_version, {"version": 1, "checkpoint": None, "published_at": time.time()})
        await asyncio.sleep(1.5)
        assert not task.done() and not paths.step_manifest(1).exists(), "the engine still serves version 0"
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{server.url}/update_weights_from_disk",
                json={"model_path": str(tiny_model_dir), "weight_version": "1"},
                timeout=60,
            )
            assert response.status_code == 200, response.text
        assert await asyncio.wait_for(task, 60) == [0, 1]
    rows = read_rows(paths, 1)
    assert rows and all(min(v for v, m in zip(r["versions"], r["loss_mask"], strict=True) if m) == 1 for r in rows)
    assert read_jsonl(paths.rollout_metrics)[1]["weight_version"] == 1


async def test_staleness_timeout_names_the_trainer_and_its_log(tmp_path: Path, tiny_model_dir: Path,
                                                               engine_url: str) -> None:  # fmt: skip
    from pipeline.errors import WaitTimeout
    from pipeline.rollout.loop import run_rollout

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, "SlowAgent", max_staleness=0, num_steps=2,
                             wait_timeout_s=1)  # fmt: skip
    with pytest.raises(WaitTimeout, match=r"weight_version\.json.*train stage.*logs/train/attempt_1\.log"):
        await run_rollout(StageContext("rollout", paths, config))
    assert paths.complete_steps() == [0]


async def test_error_rate_past_the_limit_fails_loudly(tmp_path: Path, tiny_model_dir: Path, engine_url: str) -> None:
    from pipeline.rollout.loop import AgentErrorRate, run_rollout

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, "AlwaysFails", max_error_rate=0.5)
    with pytest.raises(AgentErrorRate) as info:
        await run_rollout(StageContext("rollout", paths, config))
    message = str(info.value)
    assert "step 0: 4 of 4 agent runs failed" in message and "error rate 1.00" in message
    assert "KeyError" in message and "no such field" in message, "the last traceback is in the error"
    assert paths.complete_steps() == [], "a failed step is not published"


@pytest.mark.parametrize(
    ("agent", "cause"),
    [
        ("NeverCalls", "the proxy saw no call at all"),
        ("SwallowsItsError", "the proxy refused the last call it saw (400: "),
    ],
)
async def test_a_step_whose_agents_never_called_the_model_stops_with_what_to_do(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, agent: str, cause: str
) -> None:
    """Every run returned a reward without a model call: the rollout stops before publishing (the trainer would die
    on an empty step), saying how many runs, what the proxy saw, and what the agent must do."""
    from pipeline.rollout.loop import NoModelCalls, run_rollout

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, agent)
    with pytest.raises(NoModelCalls) as info:
        await run_rollout(StageContext("rollout", paths, config))
    message = str(info.value)
    assert message.startswith("step 0: 4 of 4 agent runs made no model call, so there is nothing to train on")
    assert cause in message and "base_url with the api_key it is given" in message
    if agent == "SwallowsItsError":
        assert "temperature" in message, "the refused call's reason is named"
    assert paths.complete_steps() == [], "nothing is published"


async def test_two_tasks_keep_their_agents_groups_and_figures_apart(tmp_path: Path, tiny_model_dir: Path,
                                                                    engine_url: str) -> None:  # fmt: skip
    """`rollout.tasks`: each prompt is run by its own task's agent, a group never mixes tasks, every row names its
    task, and the step's metrics carry figures per task; the prompts are the schedule's (resume-exact)."""
    from collections import Counter

    from pipeline.rollout.loop import build_schedule, run_rollout

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, "InlineToolAgent", num_steps=3)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"question": f"Say {i}.", "i": 100 + i}) + "\n" for i in range(4)))
    raw = config.model_dump(mode="json")
    for key in ("agent", "agent_kwargs", "dataset"):
        raw["rollout"].pop(key)
    agents = tmp_path / "agents.py"
    raw["rollout"].update(batch_size=4, max_staleness=2, tasks=[
        {"name": "tool", "agent": f"{agents}:InlineToolAgent", "dataset": {"path": str(tmp_path / "data.jsonl")}},
        {"name": "chat", "agent": f"{agents}:AnthropicWorkflow", "dataset": {"path": str(other)}, "weight": 2.0},
    ])  # fmt: skip
    config = validate_config(raw)
    paths.config.write_text(dump_config(config))
    assert await run_rollout(StageContext("rollout", paths, config)) == [0, 1, 2]

    schedule = build_schedule(config)
    metrics = {m["step"]: m for m in read_jsonl(paths.rollout_metrics)}
    for step in range(3):
        rows = read_rows(paths, step)
        tasks_of_group: dict[str, set[str]] = {}
        for row in rows:
            meta = json.loads(row["metadata"])
            tasks_of_group.setdefault(row["group_id"], set()).add(meta["task"])
            # the agent that ran it: the Anthropic workflow answers in one turn for reward 0.5
            assert (meta["task"] == "chat") == (row["num_turns"] == 1 and row["reward"] == 0.5), (meta, row["reward"])
        assert all(len(tasks) == 1 for tasks in tasks_of_group.values()), "a group never mixes tasks"
        drawn = Counter(p.task for p in schedule.prompts(step))
        assert Counter(next(iter(t)) for t in tasks_of_group.values()) == drawn, "one group per scheduled prompt"
        figures = metrics[step]
        assert figures["task/chat/samples"] + figures["task/tool/samples"] == figures["samples"] == len(rows)
        if figures["task/chat/samples"]:
            assert figures["task/chat/reward_mean"] == 0.5
    cursor = json.loads(paths.rollout_state.read_text())
    assert sum(cursor["next_positions"].values()) == 3 * 4, "each task's sequence moved by the prompts it held"
