"""EngineClient against real `hf` servers on loopback: routing, stickiness, failover, timeouts, aborts, admin calls."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.engine.client import EngineClient, EngineError
from pipeline.engine.registry import remove_entry, urls_from_registry, write_entry
from pipeline.engine.server.hf.process import ServerHandle, start_hf_server
from pipeline.net.addresses import free_port
from pipeline.run.paths import RunPaths
from schemas.engine_api import InferenceEntry

LONG = {"max_new_tokens": 1900, "ignore_eos": True}
SHORT = {"max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[list[ServerHandle]]:
    handles = [start_hf_server(tiny_model_dir, seed=i) for i in range(2)]
    yield handles
    for handle in handles:
        handle.stop()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def requests_seen(server: ServerHandle) -> int:
    return server.server.requests_total


async def wait_until(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_routes_to_the_server_with_fewest_requests_in_flight(servers: list[ServerHandle]):
    async with EngineClient([s.url for s in servers]) as client:
        results = await asyncio.gather(*(client.generate([5, 6, i], SHORT) for i in range(8)))
        assert Counter(r.server for r in results) == {servers[0].url: 4, servers[1].url: 4}
        # One long request occupies server A: the next short ones all go to B.
        long = asyncio.create_task(client.generate([5, 6], {**SHORT, "max_new_tokens": 300}))
        await wait_until(lambda: sum(client.inflight().values()) == 1)
        busy = next(url for url, n in client.inflight().items() if n == 1)
        shorts = [await client.generate([7, i], SHORT) for i in range(3)]
        assert all(r.server != busy for r in shorts)
        await long
        assert client.inflight() == {s.url: 0 for s in servers}


async def test_sticky_key_keeps_a_session_on_one_server(servers: list[ServerHandle]):
    async with EngineClient([s.url for s in servers]) as client:
        first = await client.generate([5, 6], SHORT, sticky_key="session-a")
        # Make the pinned server the busier one: the session still goes there (prefix cache).
        long = asyncio.create_task(client.generate([5], {**SHORT, "max_new_tokens": 200}, sticky_key="session-a"))
        await wait_until(lambda: sum(client.inflight().values()) == 1)
        again = [await client.generate([5, 6, i], SHORT, sticky_key="session-a") for i in range(3)]
        other = await client.generate([9], SHORT, sticky_key="session-b")
        await long
    assert {r.server for r in again} == {first.server}
    assert other.server != first.server


async def test_fails_over_on_connection_errors(servers: list[ServerHandle]):
    dead = dead_url()
    async with EngineClient([dead, servers[0].url], health_interval_s=0) as client:
        results = await asyncio.gather(*(client.generate([5, i], SHORT) for i in range(4)))
        assert {r.server for r in results} == {servers[0].url}
        streamed = [c async for c in client.generate_stream([5, 6], SHORT)]
        assert sum(len(c.new_ids) for c in streamed) == 4


async def test_all_servers_down_is_a_clear_error():
    async with EngineClient([dead_url(), dead_url()], health_interval_s=0) as client:
        with pytest.raises(EngineError, match="every inference server failed"):
            await client.generate([5], SHORT)


async def test_no_failover_on_a_4xx(servers: list[ServerHandle]):
    before = sum(requests_seen(s) for s in servers)
    async with EngineClient([s.url for s in servers]) as client:
        with pytest.raises(EngineError) as info:
            await client.generate([5, 99999], SHORT)
    assert info.value.status == 400 and "vocabulary" in str(info.value)
    assert sum(requests_seen(s) for s in servers) == before + 1  # asked once, never retried elsewhere


async def test_timeout_raises_and_aborts_on_the_server(servers: list[ServerHandle]):
    server = servers[0]
    async with EngineClient([server.url], request_timeout_s=0.5) as client:
        with pytest.raises(EngineError, match="timed out"):
            await client.generate([5, 6], LONG)
        await wait_until(lambda: server.server.scheduler.load()["running"] == 0)


async def test_cancelling_the_caller_aborts_the_request(servers: list[ServerHandle]):
    server = servers[1]
    async with EngineClient([server.url]) as client:
        task = asyncio.create_task(client.generate([5, 6], LONG))
        await wait_until(lambda: server.server.scheduler.load()["running"] == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: server.server.scheduler.load()["running"] == 0, timeout=5)


async def test_leaving_a_stream_early_aborts_it(servers: list[ServerHandle]):
    server = servers[0]
    async with EngineClient([server.url]) as client:
        stream = client.generate_stream([5, 6], LONG)
        async for chunk in stream:
            assert chunk.new_ids
            break
        await stream.aclose()
        await wait_until(lambda: server.server.scheduler.load()["running"] == 0, timeout=5)


async def test_stream_parsing_is_the_same_for_incremental_servers(tiny_model_dir: Path):
    params = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    with start_hf_server(tiny_model_dir, incremental_streaming_output=True) as incremental:
        async with EngineClient([incremental.url]) as client:
            chunks = [c async for c in client.generate_stream([5, 6, 7], params)]
            whole = await client.generate([5, 6, 7], params)
    assert [t for c in chunks for t in c.new_ids] == whole.output_ids
    assert [lp for c in chunks for lp in c.new_logprobs] == pytest.approx(whole.output_logprobs, abs=1e-6)
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


async def test_result_fields(servers: list[ServerHandle]):
    async with EngineClient([servers[0].url]) as client:
        result = await client.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        with pytest.raises(ValueError, match="n=2"):
            await client.generate([5], {"n": 2})
    assert len(result.output_ids) == len(result.output_logprobs) == result.completion_tokens == 3
    assert result.prompt_tokens == 3 and result.finish_reason == "length" and result.weight_version == 0


async def test_admin_fan_out_names_every_failing_server(servers: list[ServerHandle], tiny_model_dir: Path):
    dead_a, dead_b = dead_url(), dead_url()
    async with EngineClient([servers[0].url, dead_a, dead_b], health_interval_s=0) as client:
        with pytest.raises(EngineError) as info:
            await client.update_weights_from_disk(str(tiny_model_dir), weight_version=0)
        assert "2 of 3 servers" in str(info.value)
        assert dead_a in str(info.value) and dead_b in str(info.value) and servers[0].url not in info.value.server
    async with EngineClient([s.url for s in servers]) as client:
        await client.pause_generation()
        assert all(s.server.scheduler.paused == "in_place" for s in servers)
        await client.continue_generation()
        assert all(s.server.scheduler.paused is None for s in servers)
        assert await client.weight_version() == 0
        assert (await client.model_info())["is_generation"] is True


async def test_discovers_servers_from_the_registry(servers: list[ServerHandle], tmp_path: Path):
    paths = RunPaths(tmp_path)
    entry = InferenceEntry(
        url=servers[0].url,
        backend="hf",
        model_path="m",
        weight_version=0,
        host="localhost",
        pid=1,
        started_at=time.time(),
    )
    write_entry(paths, "server-0", entry)
    async with EngineClient(urls_from_registry(paths), health_interval_s=0.05) as client:
        assert (await client.generate([5], SHORT)).server == servers[0].url
        write_entry(paths, "server-1", entry.model_copy(update={"url": servers[1].url}))
        remove_entry(paths, "server-0")
        await wait_until(lambda: client.urls == [servers[1].url])
        assert (await client.generate([5], SHORT)).server == servers[1].url


async def test_health_checks_mark_a_dead_server_and_route_around_it(servers: list[ServerHandle]):
    dead = dead_url()
    async with EngineClient([dead, servers[1].url], health_interval_s=0) as client:
        health = await client.check_health()
        assert health == {dead: False, servers[1].url: True}
        results = await asyncio.gather(*(client.generate([5], SHORT) for _ in range(3)))
    assert {r.server for r in results} == {servers[1].url}
