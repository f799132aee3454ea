"""Execute one agent run against one proxy session: inline (a coroutine) or in a worker process.

`InlineExecutor` awaits the agent in the rollout's own event loop. `SubprocExecutor` keeps a pool
of `spawn`ed worker processes (spawned, not forked: the parent runs an event loop, uvicorn and
threads, none of which survive a fork). Each worker holds one unpickled copy of the agent, runs one
run at a time with `OPENAI_*` / `ANTHROPIC_*` set for that run, and sends back the interpreted
`Outcome` (never the raw return value, which need not pickle). A run past its deadline gets its
worker killed (by pid) and replaced, because a blocking sync agent cannot be cancelled otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import httpx

from pipeline.agents.loading import Agent, load_object
from pipeline.agents.outcome import AgentError, Outcome, interpret_result
from pipeline.errors import ArlError
from pipeline.proxy.control import SessionClient, SessionInfo, root_url


@dataclass(frozen=True)
class RunContext:
    """Where one run talks to: the proxy root URL and its session."""

    proxy_url: str
    session: SessionInfo
    temperature: float


@dataclass(frozen=True)
class RunReport:
    """What happened in one run: an outcome, or an error with its traceback."""

    outcome: Outcome | None
    error: str | None = None
    """Traceback text (or the timeout message); None when the run finished."""
    timed_out: bool = False
    duration_s: float = 0.0


class SessionEngine:
    """The `engine` a workflow's `arun_episode(engine, data)` receives: one proxy session.

    Offers exactly: `base_url` (`<proxy>/v1`, OpenAI SDK style), `anthropic_base_url` (`<proxy>`),
    `api_key` (the session key), `session_id`, `temperature` (`rollout.temperature`), `http_client`
    (an `httpx.AsyncClient`, accepted by `AsyncOpenAI`), `openai_client` (an `openai.AsyncOpenAI`
    bound to the session, built on first use), `anthropic_client` (an `anthropic.AsyncAnthropic`,
    likewise) and `await set_reward(reward, interaction_id=None)`.
    """

    def __init__(self, ctx: RunContext, http_client: httpx.AsyncClient) -> None:
        root = root_url(ctx.proxy_url)
        self.base_url = f"{root}/v1"
        self.anthropic_base_url = root
        self.api_key = ctx.session.api_key
        self.session_id = ctx.session.session_id
        self.temperature = ctx.temperature
        self.http_client = http_client
        self._session_api = SessionClient(root, ctx.session, http_client)
        self._openai: Any = None
        self._anthropic: Any = None

    @property
    def openai_client(self) -> Any:
        if self._openai is None:
            from openai import AsyncOpenAI

            # openai>=3 types the client as httpx2's but accepts a legacy httpx one at run time.
            self._openai = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, http_client=self.http_client)  # type: ignore[arg-type]
        return self._openai

    @property
    def anthropic_client(self) -> Any:
        if self._anthropic is None:
            from anthropic import AsyncAnthropic

            # The Anthropic SDK refuses httpx (non-httpx2) clients, so it gets its own connection pool.
            self._anthropic = AsyncAnthropic(base_url=self.anthropic_base_url, api_key=self.api_key)
        return self._anthropic

    async def set_reward(self, reward: float, interaction_id: str | None = None) -> None:
        await self._session_api.set_reward(reward, interaction_id)


def offered_kwargs(ctx: RunContext, http_client: httpx.AsyncClient | None) -> dict[str, Any]:
    root = root_url(ctx.proxy_url)
    return {
        "base_url": f"{root}/v1",
        "anthropic_base_url": root,
        "api_key": ctx.session.api_key,
        "http_client": http_client,
        "temperature": ctx.temperature,
    }


async def call_agent_async(agent: Agent, data: dict[str, Any], ctx: RunContext, http: httpx.AsyncClient) -> Outcome:
    """Run an async agent (or workflow) once and interpret its return value."""
    if agent.kind == "workflow":
        value = await agent.obj.arun_episode(SessionEngine(ctx, http), data)
    else:
        value = await agent.obj.run(data, **agent.run_kwargs(offered_kwargs(ctx, http)))
    return interpret_result(value, agent.spec)


class Executor(Protocol):
    async def run(self, data: dict[str, Any], ctx: RunContext, timeout_s: float) -> RunReport: ...

    async def close(self) -> None: ...


class InlineExecutor:
    """Runs the agent as a coroutine in this event loop; `http` is shared by every run (connection reuse)."""

    def __init__(self, agent: Agent, http: httpx.AsyncClient) -> None:
        if not agent.is_async:
            raise AgentError(f"agent {agent.spec!r} is synchronous; inline mode needs `async def run`")
        self.agent = agent
        self.http = http

    async def run(self, data: dict[str, Any], ctx: RunContext, timeout_s: float) -> RunReport:
        start = time.monotonic()
        try:
            outcome = await asyncio.wait_for(call_agent_async(self.agent, data, ctx, self.http), timeout_s)
        except TimeoutError:
            return RunReport(
                None,
                f"agent run timed out after {timeout_s:g}s (rollout.run_timeout_s)",
                True,
                time.monotonic() - start,
            )
        except Exception:
            return RunReport(None, traceback.format_exc(), False, time.monotonic() - start)
        return RunReport(outcome, None, False, time.monotonic() - start)

    async def close(self) -> None:
        return None


def check_picklable(obj: Any, what: str) -> bytes:
    """Pickle `obj` or raise an error naming the attribute that fails (the usual culprit: a client or lock)."""
    try:
        return pickle.dumps(obj)
    except Exception as exc:
        culprit = ""
        for name, value in vars(obj).items() if hasattr(obj, "__dict__") else []:
            try:
                pickle.dumps(value)
            except Exception as inner:
                culprit = f" (attribute {name!r}: {type(value).__name__}: {inner})"
                break
        raise AgentError(
            f"rollout.mode=subproc sends {what} to worker processes, but it does not pickle{culprit}: "
            f"{type(exc).__name__}: {exc}. Define it at module level and create clients, locks and open files "
            "inside run() rather than in __init__, or use rollout.mode=inline"
        ) from exc


class SubprocExecutor:
    """A pool of `workers` spawned processes, each running one agent run at a time."""

    def __init__(self, agent: Agent, workers: int, *, startup_timeout_s: float = 300.0) -> None:
        self.agent = agent
        self.blob = check_picklable(agent.obj, f"agent {agent.spec!r}")
        self.context = multiprocessing.get_context("spawn")
        self.startup_timeout_s = startup_timeout_s
        # Only workers that reported ready are idle: a run's deadline must not include a worker's start-up
        # (imports can take many seconds on a busy node). None in the queue = a worker failed to start.
        self.idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self.all: list[_Worker] = []
        self.init_error: str | None = None
        self._starting: set[asyncio.Task[None]] = set()
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> _Worker:
        parent, child = self.context.Pipe()
        process = self.context.Process(
            target=_worker_main,
            args=(child, self.agent.spec, self.blob, self.agent.accepts),
            daemon=True,
            name="arl-agent-worker",
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self.all.append(worker)
        task = asyncio.get_running_loop().create_task(self._await_ready(worker))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)
        return worker

    async def _await_ready(self, worker: _Worker) -> None:
        try:
            status, value = await asyncio.wait_for(_recv(worker.conn), self.startup_timeout_s)
        except TimeoutError:
            status, value = (
                "init_error",
                (f"worker process {worker.process.pid} did not report ready within {self.startup_timeout_s:g}s"),
            )
        except (EOFError, OSError) as exc:
            await asyncio.to_thread(worker.process.join, 5)
            status, value = (
                "init_error",
                (
                    f"worker process {worker.process.pid} exited during start-up (exit code {worker.process.exitcode}, "
                    f"{exc!r}); its traceback is on stderr. A spawned worker re-imports the main script: if you start "
                    "the rollout from your own script, guard it with `if __name__ == '__main__':`"
                ),
            )
        if status == "ready":
            self.idle.put_nowait(worker)
            return
        self.init_error = str(value)
        self.idle.put_nowait(None)

    async def run(self, data: dict[str, Any], ctx: RunContext, timeout_s: float) -> RunReport:
        try:
            payload = pickle.dumps((data, ctx))
        except Exception as exc:
            raise ArlError(f"rollout.mode=subproc: dataset row {str(data)[:200]!r} does not pickle: {exc}") from exc
        worker = await self.idle.get()
        if worker is None:
            self.idle.put_nowait(None)  # wake the next waiter too
            raise AgentError(f"an agent worker process failed to start (rollout.mode=subproc):\n{self.init_error}")
        start = time.monotonic()
        try:
            worker.conn.send_bytes(payload)
            reply = await asyncio.wait_for(_recv(worker.conn), timeout_s)
        except TimeoutError:
            self._replace(worker)
            return RunReport(
                None,
                f"agent run timed out after {timeout_s:g}s (rollout.run_timeout_s); its worker "
                f"process {worker.process.pid} was killed and replaced",
                True,
                time.monotonic() - start,
            )
        except (EOFError, OSError) as exc:
            code = worker.process.exitcode
            self._replace(worker)
            return RunReport(
                None,
                f"agent worker process {worker.process.pid} died (exit code {code}): {exc!r}",
                False,
                time.monotonic() - start,
            )
        self.idle.put_nowait(worker)
        status, value = reply
        if status == "ok":
            return RunReport(value, None, False, time.monotonic() - start)
        return RunReport(None, value, False, time.monotonic() - start)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.all.remove(worker)
        self._spawn()

    async def close(self) -> None:
        for task in list(self._starting):
            task.cancel()
        for worker in self.all:
            with contextlib.suppress(OSError, BrokenPipeError):
                worker.conn.send_bytes(b"")
        for worker in self.all:
            await asyncio.to_thread(worker.process.join, 5)
            worker.kill()
        self.all.clear()


async def _recv(conn: Connection) -> Any:
    """Wait for the worker's reply in the event loop (no thread: the default pool has only a few, and
    parking one per worker in a blocking `recv` would starve everything else that uses it)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    return conn.recv()  # a whole message: the worker writes each reply with one send


@dataclass
class _Worker:
    process: Any  # multiprocessing.Process of the spawn context
    conn: Connection

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()  # our own child, by pid
            self.process.join(5)
        self.conn.close()


def _worker_main(conn: Connection, spec: str, blob: bytes, accepts: frozenset[str] | None) -> None:
    """Worker process: import the agent's module (file agents pickle by module name), then serve runs."""
    from pipeline.run.logs import setup_logging

    setup_logging()
    try:
        load_object(spec)
        obj = pickle.loads(blob)
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    agent = Agent(
        obj=obj, spec=spec, kind="workflow" if hasattr(obj, "arun_episode") else "run", is_async=True, accepts=accepts
    )
    conn.send(("ready", None))
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            return
        if not payload:
            return
        data, ctx = pickle.loads(payload)
        try:
            conn.send(("ok", _run_in_worker(agent, data, ctx)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _run_in_worker(agent: Agent, data: dict[str, Any], ctx: RunContext) -> Outcome:
    root = root_url(ctx.proxy_url)
    os.environ.update(
        {
            "OPENAI_BASE_URL": f"{root}/v1",
            "OPENAI_API_KEY": ctx.session.api_key,
            "ANTHROPIC_BASE_URL": root,
            "ANTHROPIC_API_KEY": ctx.session.api_key,
        }
    )
    run = getattr(agent.obj, "run", None)
    if agent.kind == "run" and run is not None and not asyncio.iscoroutinefunction(run):
        kwargs = agent.run_kwargs(offered_kwargs(ctx, None))
        return interpret_result(run(data, **kwargs), agent.spec)
    return asyncio.run(_async_in_worker(agent, data, ctx))


async def _async_in_worker(agent: Agent, data: dict[str, Any], ctx: RunContext) -> Outcome:
    async with httpx.AsyncClient(timeout=None) as http:
        return await call_agent_async(agent, data, ctx, http)
