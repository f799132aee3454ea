"""The session router in front of two real proxies (one real hf engine, tiny model), all on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ADMIN = "arl-admin-router-test"


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.testing import start_hf_server

    with start_hf_server(tiny_model_dir) as handle:
        yield handle.url


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def stack(tiny_model_dir: Path, engine_url: str) -> AsyncIterator[tuple[str, list[Any]]]:
    """(router URL, [proxy, proxy])."""
    from pipeline.engine.client import EngineClient
    from pipeline.proxy.server import ProxyServer
    from pipeline.rollout.router import ProxyRouter
    from schemas.config import ModelConfig, ProxyConfig

    engine = EngineClient([engine_url])
    model = ModelConfig(path=str(tiny_model_dir))
    proxies = [ProxyServer(model, ProxyConfig(require_capacity=True, default_max_tokens=6), engine, admin_key=ADMIN)
               for _ in range(2)]  # fmt: skip
    urls = [await p.start() for p in proxies]
    router = ProxyRouter(urls)
    try:
        async with serve(router.app) as url:
            yield url, proxies
    finally:
        await router.http.aclose()
        for proxy in proxies:
            await proxy.stop()
        await engine.close()


def admin(http: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> Any:
    return http.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {ADMIN}"})


async def test_sessions_are_pinned_and_balanced(stack: tuple[str, list[Any]]) -> None:
    from openai import AsyncOpenAI

    url, proxies = stack
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await admin(http, url, "/rl/start_session", {})).status_code == 429  # no capacity granted yet
        sessions = []
        for _ in range(4):
            assert (await admin(http, url, "/grant_capacity", {"count": 1})).status_code == 200
            response = await admin(http, url, "/rl/start_session", {"group_id": "g", "metadata": {"k": 1}})
            assert response.status_code == 200, response.text
            sessions.append(response.json())
        owners = [[i for i, p in enumerate(proxies) if s["session_id"] in p.store.sessions] for s in sessions]
        assert sorted(o[0] for o in owners) == [0, 0, 1, 1], "least-loaded assignment spreads sessions"

        for session in sessions:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key=session["api_key"], max_retries=0)
            messages = [{"role": "user", "content": "hello"}]
            first = await client.chat.completions.create(model="arl-policy", messages=messages, max_tokens=4)
            stream = await client.chat.completions.create(model="arl-policy", max_tokens=4, stream=True,
                messages=[*messages, first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "user", "content": "again"}])  # fmt: skip
            chunks = [chunk async for chunk in stream]
            assert chunks, "the stream passes through"
            await client.close()
            reward = await http.post(f"{url}/rl/set_reward", json={"reward": 1.0},
                                     headers={"Authorization": f"Bearer {session['api_key']}"})  # fmt: skip
            assert reward.status_code == 200, reward.text
            ended = await http.post(f"{url}/rl/end_session", json={}, headers={"x-api-key": session["api_key"]})
            assert ended.status_code == 200, ended.text

        for session in sessions:
            exported = await admin(http, url, "/export_trajectories",
                                   {"session_id": session["session_id"], "style": "concat", "discount": 1.0})
            assert exported.status_code == 200, exported.text
            samples = exported.json()["samples"]
            assert len(samples) == 1 and samples[0]["num_turns"] == 2 and samples[0]["reward"] == 1.0
        again = await admin(http, url, "/export_trajectories", {"session_id": sessions[0]["session_id"]})
        assert again.status_code == 404 and again.json()["error"]["code"] == "unknown_session"


async def test_unknown_sessions_get_api_shaped_404s(stack: tuple[str, list[Any]]) -> None:
    url, _ = stack
    async with httpx.AsyncClient(timeout=30) as http:
        chat = await http.post(f"{url}/v1/chat/completions", json={"messages": []},
                               headers={"Authorization": "Bearer arl-sess-nope"})  # fmt: skip
        assert chat.status_code == 404 and chat.json()["error"]["type"] == "invalid_request_error"
        messages = await http.post(f"{url}/v1/messages", json={}, headers={"x-api-key": "arl-sess-nope"})
        assert messages.status_code == 404 and messages.json()["type"] == "error"
        assert messages.json()["error"]["type"] == "not_found_error"
        anonymous = await http.post(f"{url}/v1/chat/completions", content=b"not json")
        assert 400 <= anonymous.status_code < 500  # the proxy's own answer: no key
        health = await http.get(f"{url}/health")
        assert health.status_code == 200 and len(health.json()["proxies"]) == 2
