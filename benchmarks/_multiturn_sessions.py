"""Eight-turn tool-using sessions through the real proxy and a real `hf` engine, exported both ways.

Shared by `benchmarks/concat_tokens.py` and `tests/integration/test_concat_vs_individual.py` (the
leading underscore keeps `arl bench` from running it as a benchmark).

The agent (`FixedTurnsToolAgent`) is the calculator agent of `examples/agents/tool_agent.py` (its
tool schema and tool runner, imported from there) with a fixed budget of model calls: a random-init
tiny model almost never writes a well-formed tool call, so where the calculator agent would stop
after one turn, this one answers a reply without a tool call with a user message asking it to check
with the calculator, and calls the model again, `turns` times in all. Every request re-sends the
whole conversation (the assistant messages exactly as the SDK returned them), as an unmodified
OpenAI-SDK agent does; nothing in it knows about arl.

`collect_sessions` runs it the way the rollout stage does: an `hf` engine (in a thread), a
`ProxyServer` in this event loop, one proxy session per run driven through `proxy.control`
(start → agent over HTTP with the session key → reward → end → export). The export API hands a
session over once and then forgets it, so the `individual` rows are taken from the session's
recorded conversation tree by the same `SessionTree.export` the API runs, just before the API
exports the session as `concat`: both styles come from the same recorded tokens.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "agents"))
from tool_agent import CALCULATOR, run_tool_call  # the calculator agent's own tool, next to it  # noqa: E402

DATASET = REPO / "examples" / "data" / "arithmetic.jsonl"


class FixedTurnsToolAgent:
    """The calculator agent with exactly `turns` model calls (see the module docstring)."""

    required_fields = ("question", "answer")

    def __init__(self, turns: int = 8, max_tokens: int = 24, model: str = "arl-policy") -> None:
        self.turns = turns
        self.max_tokens = max_tokens
        self.model = model

    async def run(self, data: dict[str, Any], *, base_url: str, api_key: str,
                  http_client: httpx.AsyncClient | None = None, temperature: float = 1.0,
                  **_: Any) -> float:  # fmt: skip
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)  # type: ignore[arg-type]
        messages: list[Any] = [
            {"role": "system", "content": "Use the calculator tool for arithmetic, then give the number."},
            {"role": "user", "content": data["question"]},
        ]
        answer, good_calls = "", 0
        for turn in range(self.turns):
            completion = await client.chat.completions.create(
                model=self.model, messages=messages, tools=[CALCULATOR],  # type: ignore[list-item]
                max_tokens=self.max_tokens, temperature=temperature,
            )  # fmt: skip
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                result, ok = run_tool_call(call)
                good_calls += ok
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not message.tool_calls:
                answer = message.content or ""
                left = self.turns - turn - 1
                messages.append({"role": "user", "content": f"Check that with the calculator ({left} turns left)."})
        return float(str(data["answer"]) in answer) + 0.1 * min(good_calls, 2)


@dataclass
class SessionExport:
    """One agent run's rows, exported both ways from the same recorded session."""

    session_id: str
    concat: list[Any]
    """`TrajectoryRow`s of `export_style: concat` (one per root-to-leaf path, cut at prefix breaks)."""
    individual: list[Any]
    """`TrajectoryRow`s of `export_style: individual` (one per LLM call)."""
    num_interactions: int
    prefix_breaks: int


def load_prompts(count: int, group_size: int) -> list[dict[str, Any]]:
    """`count` runs over the first `count / group_size` arithmetic questions, `group_size` runs each."""
    rows = [json.loads(line) for line in DATASET.read_text().splitlines() if line.strip()]
    return [rows[i // group_size % len(rows)] for i in range(count)]


async def collect_sessions(model_dir: str | Path, *, sessions: int, turns: int = 8, max_tokens: int = 24,
                           group_size: int = 4, concurrency: int = 8, seed: int = 0,
                           discount: float = 1.0) -> list[SessionExport]:  # fmt: skip
    """Run `sessions` agent runs through a fresh engine and proxy; each run's rows in both styles."""
    from pipeline.engine.client import EngineClient
    from pipeline.engine.server.hf.process import start_hf_server
    from pipeline.proxy.server import ProxyServer
    from schemas.config.model import ModelConfig
    from schemas.config.proxy import ProxyConfig

    server = await asyncio.to_thread(start_hf_server, model_dir, max_batch_size=concurrency, seed=seed)
    engine = EngineClient([server.url], health_interval_s=0)
    # history: sampled. The random tiny model samples special tokens and spacing its template would not write back,
    # so under the default (`template`) most of its turns would break the row; a model that writes its template's
    # format (any trained one) keeps one row under either setting, and one row per session is what this measures.
    config = ProxyConfig(max_tokens_limit=max(max_tokens, 64), history="sampled")
    proxy = ProxyServer(ModelConfig(path=str(model_dir)), config, engine,
                        admin_key="arl-admin-" + secrets.token_urlsafe(16))  # fmt: skip
    try:
        await proxy.start()
        agent = FixedTurnsToolAgent(turns=turns, max_tokens=max_tokens)
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=120) as http:

            async def one(index: int, data: dict[str, Any]) -> SessionExport:
                async with limit:
                    return await run_session(proxy, agent, http, data, f"prompt{index // group_size}", discount)

            prompts = load_prompts(sessions, group_size)
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await proxy.stop()
        await engine.close()
        await asyncio.to_thread(server.stop)


async def run_session(proxy: Any, agent: FixedTurnsToolAgent, http: httpx.AsyncClient, data: dict[str, Any],
                      group_id: str, discount: float) -> SessionExport:  # fmt: skip
    """One run in its own proxy session, as the rollout drives it; its rows in both export styles."""
    control = proxy.control
    await control.grant_capacity()
    info = await control.start_session(group_id, {"question": data["question"]})
    reward = await agent.run(data, base_url=f"{proxy.url}/v1", api_key=info.api_key, http_client=http)
    await control.set_reward(info.session_id, reward)
    await control.end_session(info.session_id)
    individual = proxy.store.get(info.session_id).tree.export("individual", discount)
    exported = await control.export(info.session_id, style="concat", discount=discount)
    return SessionExport(info.session_id, exported.rows, individual, exported.num_interactions, exported.prefix_breaks)
