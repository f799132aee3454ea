"""Several proxy workers (`proxy.workers`): real worker processes, a real hf engine (tiny model), the real
standalone proxy stage and OpenAI SDK clients. What a pool must not do: lose an interaction, record one
twice, let capacity be spent twice or bounded per worker, or serve a session on a worker that does not
hold it."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from pipeline.run.stage import StageContext
from tests.integration.test_external_agents import CLIENT_KEY, make_run, wait_until

SESSIONS = 256


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.server.hf.process import start_hf_server

    with start_hf_server(tiny_model_dir) as handle:
        yield handle.url


async def _two_turns(session: Any, index: int) -> int:
    """Two calls, the second extending the first (the token-exact path); the completion tokens the proxy billed."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, http_client=session.http)
    messages: list[Any] = [{"role": "user", "content": f"count to {index}"}]
    billed = 0
    for _ in range(2):
        answer = await client.chat.completions.create(model="arl-policy", messages=messages, max_tokens=3,
                                                      temperature=1.0)  # fmt: skip
        assert answer.usage is not None
        billed += answer.usage.completion_tokens
        messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                     {"role": "user", "content": "go on"}]  # fmt: skip
    await session.set_reward(float(index % 2))
    return billed


async def test_256_concurrent_sessions_over_two_workers_are_each_recorded_once(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str
) -> None:
    from pipeline.client import AgentSession, pooled_http_client, resolve_proxy_urls
    from pipeline.rollout.external import run_external
    from pipeline.run.shards import read_manifest, read_step

    config, paths = make_run(tmp_path, tiny_model_dir, engine_url, max_staleness=1, batch_size=SESSIONS // 2,
                             export_style="concat")  # fmt: skip
    # history: sampled: the random tiny model's replies (special tokens, spacing) are not what its template writes
    # back, so under `template` some sessions would be two rows; this counts each session's tokens in one row.
    proxy = config.proxy.model_copy(update={"workers": 2, "max_sessions": SESSIONS, "history": "sampled"})
    config = config.model_copy(update={"proxy": proxy})
    stage = asyncio.create_task(run_external(StageContext("proxy", paths, config)))
    await wait_until(lambda: paths.proxy_entry("external").exists(), stage, timeout=180)
    urls = resolve_proxy_urls(paths.root)
    assert len(urls) == 2 and len(set(urls)) == 2
    billed: dict[str, int] = {}
    workers: Counter[str] = Counter()

    async def one(index: int, http: httpx.AsyncClient) -> None:
        async with AgentSession(urls[index % 2], client_key=CLIENT_KEY, group_id=f"g{index // 4}",
                                http_client=http) as session:  # fmt: skip
            billed[session.session_id] = await _two_turns(session, index)
            workers[session.session_id[:2]] += 1

    async with pooled_http_client(300) as http:
        await asyncio.gather(*(one(i, http) for i in range(SESSIONS)))
    assert await asyncio.wait_for(stage, 120) == [0, 1]
    assert workers == {"00": SESSIONS // 2, "01": SESSIONS // 2}, "each session's id names the worker it lives on"

    recorded: Counter[str] = Counter()
    for step in (0, 1):
        rows = read_step(paths, step).to_pylist()
        for row in rows:
            recorded[row["session_id"]] += 1
            sampled = sum(row["loss_mask"])
            assert sampled == billed[row["session_id"]], "both turns' tokens, once each, in one concat row"
        assert read_manifest(paths, step).extra["sessions"] == SESSIONS // 2
    assert set(recorded) == set(billed) and set(recorded.values()) == {1}, "every session in exactly one step"
    assert not list(paths.proxy_spool.glob("*.json"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tiny_model_dir: Path, engine_url: str) -> Any:
    """One pool for the tests below (started once: spawning two workers takes seconds); the last one kills a
    worker."""
    from pipeline.proxy.pool import open_pool
    from schemas.config.model import ModelConfig
    from schemas.config.proxy import ProxyConfig

    proxy = ProxyConfig(workers=2, max_sessions=3, require_capacity=True, client_keys=[CLIENT_KEY])
    async with (
        httpx.AsyncClient(timeout=60) as http,
        open_pool(ModelConfig(path=str(tiny_model_dir)), proxy, admin_key="pool-admin", http=http,
                  engine_urls=[engine_url]) as (started, control),
    ):  # fmt: skip
        yield started, control, http


@pytest.mark.asyncio(loop_scope="module")
async def test_capacity_and_the_session_bound_are_counted_across_workers(pool: Any) -> None:
    from pipeline.proxy.control import HttpControl, NoCapacity

    started, control, http = pool
    # Two slots granted through worker 1's HTTP route are spent by starts on either worker, once each.
    await HttpControl(started.urls[1], "pool-admin", http).grant_capacity(2)
    first = await control.start_session()
    second = await control.start_session()
    assert {first.session_id[:2], second.session_id[:2]} == {"00", "01"}
    with pytest.raises(NoCapacity, match="no capacity"):
        await control.start_session()
    # max_sessions (3) bounds the pool, not each worker: the fourth open session is refused wherever it lands.
    await control.grant_capacity(5)
    await control.start_session()
    for _ in range(2):
        with pytest.raises(NoCapacity, match=r"too many open sessions \(3"):
            await control.start_session()
    await control.end_session(first.session_id)
    exported = await control.export(first.session_id, style="individual", discount=1.0)
    assert exported.session_id == first.session_id and exported.rows == []
    assert control.capacity.open == 2 and control.capacity.started == 3
    health = [(await http.get(f"{url}/health")).json()["open_sessions"] for url in started.urls]
    assert health == [2, 2], "each worker reports the pool's open sessions"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_session_key_sent_to_another_worker_is_answered_421_naming_its_worker(pool: Any) -> None:
    started, control, http = pool
    await control.grant_capacity(1)  # the third open session of max_sessions 3 (the test above left two)
    session = await control.start_session()
    owner = int(session.session_id[:2], 16)
    assert session.url == started.urls[owner]
    other = started.urls[1 - owner]
    body = {"model": "arl-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {session.api_key}"}
    wrong = await http.post(f"{other}/v1/chat/completions", json=body, headers=headers)
    assert wrong.status_code == 421, wrong.text
    assert f"served by proxy worker {owner}" in wrong.json()["error"]["message"]
    right = await http.post(f"{session.url}/v1/chat/completions", json=body, headers=headers)
    assert right.status_code == 200, right.text


@pytest.mark.asyncio(loop_scope="module")
async def test_a_dead_worker_stops_the_pool_with_its_name(pool: Any) -> None:
    started, _control, _http = pool
    victim = started.workers[1].process
    victim.kill()
    for _ in range(40):
        if started.error:
            break
        await asyncio.sleep(0.25)
    with pytest.raises(Exception, match=r"proxy worker 1 .* exited with code -9"):
        started.check()


def test_the_registry_entry_lists_every_worker(tmp_path: Path) -> None:
    from pipeline.client import resolve_proxy_url, resolve_proxy_urls
    from pipeline.proxy.services import registry_entry

    registry = tmp_path / "registry" / "proxy"
    registry.mkdir(parents=True)
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    (registry / "external.json").write_text(json.dumps(registry_entry(urls)))
    assert resolve_proxy_urls(tmp_path) == urls
    assert {resolve_proxy_url(tmp_path) for _ in range(64)} == set(urls), "sessions spread over the workers"
