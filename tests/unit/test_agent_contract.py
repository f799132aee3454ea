"""Contract tests for agent plug-ins: how they are named, what shapes are accepted, what returns mean."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path

import httpx
import pytest

from pipeline.agents.loading import load_object, resolve_agent
from pipeline.agents.outcome import AgentError, AgentReturnError, interpret_result
from pipeline.agents.runner import InlineExecutor, RunContext, check_picklable
from pipeline.proxy.control import SessionInfo

AGENTS = textwrap.dedent(
    """
    import threading

    class AsyncAgent:
        def __init__(self, bonus=0.0):
            self.bonus = bonus
        async def run(self, data, **kwargs):
            self.seen = kwargs
            return data["x"] + self.bonus

    class Narrow:
        async def run(self, data, base_url, api_key):
            return {"a": 1.0, "b": 0}

    class SyncAgent:
        def run(self, data, **kwargs):
            return 1.0

    class Workflow:
        async def arun_episode(self, engine, data):
            self.engine = engine
            return None

    class SyncWorkflow:
        def arun_episode(self, engine, data):
            return 1.0

    class NoRun:
        pass

    class NotCallable:
        run = 3

    class Locked:
        def __init__(self):
            self.lock = threading.Lock()
        async def run(self, data, **kwargs):
            return 0.0

    instance = AsyncAgent(bonus=1.0)

    def factory():
        return AsyncAgent(bonus=2.0)

    class Bad:
        async def run(self, data, **kwargs):
            return "yes"
    """
)


@pytest.fixture
def agent_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_agents.py"
    path.write_text(AGENTS)
    return path


def test_file_and_module_specs_load(agent_file: Path) -> None:
    cls = load_object(f"{agent_file}:AsyncAgent")
    assert cls.__name__ == "AsyncAgent"
    assert load_object("pipeline.agents.outcome:interpret_result") is interpret_result


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "must look like"),
        ("pipeline.rollout.nonexistent_mod:X", "cannot import module"),
        ("/does/not/exist.py:X", "does not exist"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(AgentError, match=message):
        load_object(spec)


def test_missing_attribute_lists_what_exists(agent_file: Path) -> None:
    with pytest.raises(AgentError, match=r"no attribute 'Missing'.*AsyncAgent"):
        load_object(f"{agent_file}:Missing")


def test_class_constructed_with_kwargs(agent_file: Path) -> None:
    agent = resolve_agent(f"{agent_file}:AsyncAgent", {"bonus": 0.5})
    assert agent.kind == "run" and agent.is_async and agent.obj.bonus == 0.5
    assert agent.accepts is None  # **kwargs: gets every offered kwarg


def test_bad_constructor_kwargs(agent_file: Path) -> None:
    with pytest.raises(AgentError, match="agent_kwargs"):
        resolve_agent(f"{agent_file}:AsyncAgent", {"nope": 1})


def test_instance_and_factory(agent_file: Path) -> None:
    assert resolve_agent(f"{agent_file}:instance").obj.bonus == 1.0
    assert resolve_agent(f"{agent_file}:factory").obj.bonus == 2.0
    with pytest.raises(AgentError, match="instance, not a class"):
        resolve_agent(f"{agent_file}:instance", {"bonus": 3})


def test_narrow_signature_gets_only_declared_kwargs(agent_file: Path) -> None:
    agent = resolve_agent(f"{agent_file}:Narrow")
    offered = {"base_url": "u", "api_key": "k", "http_client": None, "temperature": 1.0}
    assert agent.run_kwargs(offered) == {"base_url": "u", "api_key": "k"}


def test_workflow_interface(agent_file: Path) -> None:
    agent = resolve_agent(f"{agent_file}:Workflow")
    assert agent.kind == "workflow"
    with pytest.raises(AgentError, match="async def arun_episode"):
        resolve_agent(f"{agent_file}:SyncWorkflow")


def test_sync_run_refused_inline_allowed_subproc(agent_file: Path) -> None:
    with pytest.raises(AgentError, match=r"rollout\.mode=subproc"):
        resolve_agent(f"{agent_file}:SyncAgent", mode="inline")
    agent = resolve_agent(f"{agent_file}:SyncAgent", mode="subproc")
    assert not agent.is_async


@pytest.mark.parametrize(("attr", "message"), [("NoRun", "has neither"), ("NotCallable", "not a method")])
def test_not_an_agent(agent_file: Path, attr: str, message: str) -> None:
    with pytest.raises(AgentError, match=message):
        resolve_agent(f"{agent_file}:{attr}")


def test_return_values() -> None:
    assert interpret_result(None).rejected
    assert interpret_result(0.25).reward == 0.25
    assert interpret_result(1).reward == 1.0
    assert interpret_result(True).reward == 1.0
    outcome = interpret_result({"chatcmpl-1": 1, "chatcmpl-2": -0.5})
    assert not outcome.rejected and outcome.reward is None
    assert outcome.rewards == {"chatcmpl-1": 1.0, "chatcmpl-2": -0.5}
    assert interpret_result({}).rewards == {}


def test_a_pair_adds_agent_metrics_to_either_reward_form() -> None:
    outcome = interpret_result((0.5, {"exact_correct": True, "digits": 2}))
    assert outcome.reward == 0.5 and outcome.metrics == {"exact_correct": 1.0, "digits": 2.0}
    outcome = interpret_result(({"chatcmpl-1": 1.0}, {"ok": 0.0}))
    assert outcome.rewards == {"chatcmpl-1": 1.0} and outcome.metrics == {"ok": 0.0}


@pytest.mark.parametrize("value", [(0.5,), (0.5, {}, 1), (None, {"a": 1}), (0.5, [1.0]), (0.5, {"a b": 1}),
                                   (0.5, {"a": float("nan")}), (0.5, {"a": "1"}), ((0.5, {}), {})])  # fmt: skip
def test_bad_pairs_are_errors(value: object) -> None:
    with pytest.raises(AgentReturnError, match="agent"):
        interpret_result(value)


@pytest.mark.parametrize("value", ["1.0", [1.0], {"a": "x"}, {1: 1.0}, float("nan"), float("inf")])
def test_wrong_return_types_are_errors(value: object) -> None:
    with pytest.raises(AgentReturnError, match="agent"):
        interpret_result(value)


async def test_inline_executor_turns_a_bad_return_into_a_counted_error(agent_file: Path) -> None:
    agent = resolve_agent(f"{agent_file}:Bad")
    ctx = RunContext("http://127.0.0.1:9", SessionInfo("s1", "key"), 1.0)
    async with httpx.AsyncClient() as http:
        report = await InlineExecutor(agent, http).run({}, ctx, timeout_s=5)
    assert report.outcome is None and report.error is not None
    assert "returned str" in report.error and not report.timed_out


async def test_inline_executor_passes_kwargs_and_times_out(agent_file: Path, tmp_path: Path) -> None:
    agent = resolve_agent(f"{agent_file}:AsyncAgent")
    ctx = RunContext("http://127.0.0.1:9/v1/", SessionInfo("s1", "key"), 0.7)
    async with httpx.AsyncClient() as http:
        report = await InlineExecutor(agent, http).run({"x": 0.5}, ctx, timeout_s=5)
        assert report.outcome is not None and report.outcome.reward == 0.5
        seen = agent.obj.seen
        assert seen["base_url"] == "http://127.0.0.1:9/v1" and seen["anthropic_base_url"] == "http://127.0.0.1:9"
        assert seen["api_key"] == "key" and seen["temperature"] == 0.7 and seen["http_client"] is http

        slow = tmp_path / "slow.py"
        slow.write_text("import asyncio\nclass Slow:\n    async def run(self, data, **kw):\n"
                        "        await asyncio.sleep(30)\n")  # fmt: skip
        report = await InlineExecutor(resolve_agent(f"{slow}:Slow"), http).run({}, ctx, timeout_s=0.2)
    assert report.timed_out and "run_timeout_s" in (report.error or "")


def test_unpicklable_agent_names_the_attribute(agent_file: Path) -> None:
    agent = resolve_agent(f"{agent_file}:Locked")
    with pytest.raises(AgentError, match=r"attribute 'lock'.*rollout.mode=inline"):
        check_picklable(agent.obj, "agent")


def test_file_agents_pickle_by_a_stable_module_name(agent_file: Path) -> None:
    agent = resolve_agent(f"{agent_file}:AsyncAgent", {"bonus": 3.0})
    clone = pickle.loads(check_picklable(agent.obj, "agent"))
    assert clone.bonus == 3.0 and type(clone) is type(agent.obj)
