"""Run agents from any machine against an arl proxy: `AgentSession` (one run) and `AgentRunner` (a dataset).

    async with AgentSession("http://proxy-node:8000", client_key="ck-team-a") as session:
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        ...                                   # the agent, unmodified
        await session.set_reward(1.0)         # the last completion's reward

The proxy is given as its URL, or as a run directory (its `registry/proxy/*.json` names the URL;
the entry never holds a key). Starting a session waits (with a deadline) while the proxy answers
429: a standalone proxy admits sessions only while the trainer's weights are fresh enough
(`rollout.max_staleness`). Leaving the block ends the session; an exception leaving it marks the
run failed (the proxy stage then trains on none of its samples) and propagates.

Only `httpx` is needed here (no torch, no transformers), so this module installs anywhere: it uses the
proxy's HTTP control (`pipeline.proxy.control`) and the agent return-value contract (`pipeline.agents.outcome`),
nothing of the rollout. Endpoints: docs/proxy.md; the stage that serves outside agents: docs/rollout.md.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from pipeline.agents.outcome import interpret_result
from pipeline.errors import ArlError
from pipeline.proxy.control import HttpControl, NoCapacity, SessionClient, SessionInfo, root_url

log = logging.getLogger("arl.client")


def pooled_http_client(timeout_s: float) -> httpx.AsyncClient:
    """The httpx client this module makes for many agents' calls at once: over aiohttp's pool, as the rollout's
    inline agents get (`pipeline.proxy.services.agent_http_client`). Not httpcore's: it hands a waiting request
    a pooled connection that still counts as idle until the request starts on it, and closes idle connections
    that are past their keep-alive expiry, or surplus to `max_keepalive_connections` (counted over all
    connections), in between; with many calls in flight on a busy event loop, a call then had its connection
    closed under it after sending it ("Connection error.", the proxy seeing its client hang up)."""
    from pipeline.proxy.services import agent_http_client

    return agent_http_client(timeout_s, transport="network")


__all__ = ["AgentRunner", "AgentSession", "RunnerSummary", "resolve_proxy_url", "resolve_proxy_urls"]


def resolve_proxy_url(proxy: str | Path, name: str | None = None) -> str:
    """A proxy URL as given, or read from `<run dir>/registry/proxy/<name>.json` (the only entry if no name): one
    of its workers' URLs at random when the proxy runs several (`proxy.workers`), which spreads sessions."""
    return random.choice(resolve_proxy_urls(proxy, name))


def resolve_proxy_urls(proxy: str | Path, name: str | None = None) -> list[str]:
    """Every worker URL of the proxy `resolve_proxy_url` names (one for a proxy URL given as such)."""
    text = str(proxy)
    if text.startswith(("http://", "https://")):
        return [root_url(text)]
    registry = Path(proxy) / "registry" / "proxy"
    entries = sorted(registry.glob("*.json")) if registry.is_dir() else []
    entries = [e for e in entries if not e.name.endswith(".tmp")]
    if name is not None:
        entries = [e for e in entries if e.stem == name]
    if not entries:
        raise ArlError(
            f"no proxy registered under {registry}{f' named {name!r}' if name else ''}: is "
            "`arl stage proxy` running for this run dir? (or pass the proxy's URL)"
        )
    if len(entries) > 1:
        raise ArlError(f"several proxies registered under {registry} ({[e.stem for e in entries]}): pass name=")
    entry = json.loads(entries[0].read_text())
    return [root_url(str(url)) for url in entry.get("urls") or [entry["url"]]]


class AgentSession:
    """One agent run in one proxy session (an async context manager)."""

    def __init__(
        self,
        proxy: str | Path,
        *,
        client_key: str,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        http_client: httpx.AsyncClient | None = None,
        start_timeout_s: float = 600.0,
        proxy_name: str | None = None,
    ) -> None:
        self.proxy_url = resolve_proxy_url(proxy, proxy_name)
        self.client_key = client_key
        self.group_id = group_id
        self.metadata = metadata or {}
        self.start_timeout_s = start_timeout_s
        self._http = http_client
        self._own_http = http_client is None
        self._info: SessionInfo | None = None
        self.failed = False
        self.error: str | None = None
        self.rejected = False

    @property
    def session_id(self) -> str:
        return self._require().session_id

    @property
    def api_key(self) -> str:
        """The session key: the agent's API key for both SDKs."""
        return self._require().api_key

    @property
    def base_url(self) -> str:
        """`<proxy>/v1`: the OpenAI SDK's `base_url`."""
        return f"{self.proxy_url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """`<proxy>`: the Anthropic SDK's `base_url` (it appends `/v1/messages` itself)."""
        return self.proxy_url

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = pooled_http_client(600.0)
        return self._http

    def _require(self) -> SessionInfo:
        if self._info is None:
            raise ArlError("the session has not started: use `async with AgentSession(...) as session:`")
        return self._info

    async def __aenter__(self) -> AgentSession:
        api = HttpControl(self.proxy_url, self.client_key, self.http)
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.2
        while True:
            try:
                self._info = await api.start_session(self.group_id, self.metadata)
                return self
            except NoCapacity as exc:
                if time.monotonic() + delay > deadline:
                    await self._close_http()
                    raise ArlError(
                        f"{self.proxy_url} admitted no session for {self.start_timeout_s:g}s (429: {exc.body[:300]}). "
                        "The proxy holds sessions back while the trainer's weights are too stale "
                        "(rollout.max_staleness): is the train stage running?"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except BaseException:
                await self._close_http()
                raise

    async def set_reward(self, reward: float, interaction_id: str | None = None) -> None:
        """Reward the last completion (or the completion/response/message with `interaction_id`)."""
        await SessionClient(self.proxy_url, self._require(), self.http).set_reward(reward, interaction_id)

    def reject(self) -> None:
        """Train on none of this run's samples (the run is still ended cleanly)."""
        self.rejected = True

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self.failed = True
            self.error = "".join(traceback.format_exception(exc_type, exc, tb))
        status = "failed" if self.failed else "rejected" if self.rejected else None
        try:
            if self._info is not None:
                await SessionClient(self.proxy_url, self._info, self.http).end(status)
        finally:
            await self._close_http()

    async def _close_http(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None


@dataclass
class RunnerSummary:
    runs: int = 0
    finished: int = 0
    rejected: int = 0
    failed: int = 0
    timeouts: int = 0
    rewards: list[float] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    """Per-run agent metrics (a `(reward, {name: value})` return), by name. The proxy stage's shards do not
    carry them: an external runner's metrics stay with the runner."""
    errors: list[str] = field(default_factory=list)
    """The tracebacks of failed runs (the last 20)."""
    duration_s: float = 0.0

    @property
    def reward_mean(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


AgentFn = Callable[[AgentSession, dict[str, Any]], Awaitable[Any] | Any]


class AgentRunner:
    """Run `agent_fn(session, data)` over a dataset against a proxy, `group_size` runs per item.

    `agent_fn` returns what a rollout agent returns: a number (the last completion's reward), a dict
    `{interaction_id: reward}`, None (reject the run), or a pair (either reward form, {metric: number}).
    It may be sync (it then runs in a thread).
    """

    def __init__(
        self,
        proxy: str | Path,
        *,
        client_key: str,
        group_size: int = 1,
        max_concurrency: int = 8,
        run_timeout_s: float = 300.0,
        start_timeout_s: float = 600.0,
        proxy_name: str | None = None,
    ) -> None:
        self.proxy_urls = resolve_proxy_urls(proxy, proxy_name)
        self.proxy_url = self.proxy_urls[0]
        self.client_key = client_key
        self.group_size = group_size
        self.max_concurrency = max_concurrency
        self.run_timeout_s = run_timeout_s
        self.start_timeout_s = start_timeout_s

    async def run(self, agent_fn: AgentFn, dataset: Iterable[dict[str, Any]]) -> RunnerSummary:
        summary = RunnerSummary()
        started = time.monotonic()
        prefix = uuid.uuid4().hex[:8]
        limit = asyncio.Semaphore(self.max_concurrency)
        async with pooled_http_client(self.run_timeout_s + 60) as http:

            async def one(index: int, data: dict[str, Any]) -> None:
                async with limit:
                    await self._one(agent_fn, data, f"{prefix}-{index}", index, http, summary)

            async with asyncio.TaskGroup() as group:
                for index, data in enumerate(dataset):
                    for _ in range(self.group_size):
                        group.create_task(one(index, data))
        summary.duration_s = time.monotonic() - started
        return summary

    async def _one(
        self,
        agent_fn: AgentFn,
        data: dict[str, Any],
        group_id: str,
        index: int,
        http: httpx.AsyncClient,
        summary: RunnerSummary,
    ) -> None:
        summary.runs += 1
        # Sessions spread over the proxy's workers in turn (each session stays on the one it started on).
        url = self.proxy_urls[summary.runs % len(self.proxy_urls)]
        session = AgentSession(
            url,
            client_key=self.client_key,
            group_id=group_id,
            metadata={"dataset_index": index},
            http_client=http,
            start_timeout_s=self.start_timeout_s,
        )
        try:
            async with session:
                value = await asyncio.wait_for(_call(agent_fn, session, data), self.run_timeout_s)
                outcome = interpret_result(value, getattr(agent_fn, "__name__", "agent_fn"))
                if outcome.rejected:
                    session.reject()
                    summary.rejected += 1
                    return
                if outcome.reward is not None:
                    await session.set_reward(outcome.reward)
                for interaction_id, reward in outcome.rewards.items():
                    await session.set_reward(reward, interaction_id)
        except Exception as exc:
            summary.failed += 1
            summary.timeouts += isinstance(exc, TimeoutError)
            summary.errors = [*summary.errors[-19:], session.error or traceback.format_exc()]
            log.warning("agent run on dataset item %d failed: %r", index, exc)
            return
        summary.finished += 1
        if outcome.reward is not None:
            summary.rewards.append(outcome.reward)
        for name, value in outcome.metrics.items():
            summary.metrics.setdefault(name, []).append(value)


async def _call(agent_fn: AgentFn, session: AgentSession, data: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(agent_fn):
        return await agent_fn(session, data)
    return await asyncio.to_thread(agent_fn, session, data)
