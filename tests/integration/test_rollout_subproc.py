"""The subproc executor with real spawned worker processes: environment per run, sync agents,
errors with tracebacks, and a run past its deadline killing and replacing its worker."""

from __future__ import annotations

from pathlib import Path

from pipeline.agents.loading import resolve_agent
from pipeline.agents.runner import RunContext, SubprocExecutor
from pipeline.proxy.control import SessionInfo

AGENTS = """
import os, time

class EnvAgent:
    def run(self, data, **kwargs):
        if data.get("sleep"):
            time.sleep(data["sleep"])
        if data.get("boom"):
            raise ValueError("boom from the worker")
        env = (os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"],
               os.environ["ANTHROPIC_BASE_URL"], os.environ["ANTHROPIC_API_KEY"])
        expected = (kwargs["base_url"], kwargs["api_key"], kwargs["anthropic_base_url"], kwargs["api_key"])
        return {"pid": float(os.getpid())} if env == expected else None
"""


async def test_subproc_env_errors_and_timeouts(tmp_path: Path) -> None:
    path = tmp_path / "env_agent.py"
    path.write_text(AGENTS)
    agent = resolve_agent(f"{path}:EnvAgent", mode="subproc")
    executor = SubprocExecutor(agent, workers=1)
    try:
        ctx = RunContext("http://127.0.0.1:1234/", SessionInfo("s1", "sess-key-1"), 1.0)
        ok = await executor.run({}, ctx, timeout_s=60)
        assert ok.outcome is not None and not ok.outcome.rejected, ok.error
        first_pid = ok.outcome.rewards["pid"]

        other = RunContext("http://127.0.0.1:999", SessionInfo("s2", "sess-key-2"), 1.0)
        again = await executor.run({}, other, timeout_s=60)
        assert again.outcome is not None and again.outcome.rewards["pid"] == first_pid, "env is set per run"

        failed = await executor.run({"boom": True}, ctx, timeout_s=60)
        assert failed.outcome is None and "ValueError: boom from the worker" in (failed.error or "")

        slow = await executor.run({"sleep": 60}, ctx, timeout_s=1.0)
        assert slow.timed_out and "killed and replaced" in (slow.error or "")
        after = await executor.run({}, ctx, timeout_s=60)
        assert after.outcome is not None and after.outcome.rewards["pid"] != first_pid, "a fresh worker"
    finally:
        await executor.close()
    assert not executor.all


async def test_worker_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    import pytest

    from pipeline.agents.outcome import AgentError

    path = tmp_path / "worker_hostile.py"
    path.write_text("import multiprocessing\n"
                    "if multiprocessing.parent_process() is not None:\n"
                    "    raise RuntimeError('this module refuses to load in a worker')\n"
                    "class Agent:\n    def run(self, data, **kw):\n        return 1.0\n")  # fmt: skip
    executor = SubprocExecutor(resolve_agent(f"{path}:Agent", mode="subproc"), workers=2)
    ctx = RunContext("http://127.0.0.1:1", SessionInfo("s", "k"), 1.0)
    try:
        for _ in range(2):  # every waiter is told, not only the first
            with pytest.raises(AgentError, match=r"(?s)failed to start.*refuses to load in a worker"):
                await executor.run({}, ctx, timeout_s=60)
    finally:
        await executor.close()
