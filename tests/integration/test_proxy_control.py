"""`ProxyControl` against a real proxy and a real `hf` engine: the in-process `LocalControl` and the
`HttpControl` drive a session the same way and hand back the same typed rows, and an end call's
`x-arl-run-status` reaches the session store's end subscribers through the route handler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.proxy.control import HttpControl, NoCapacity, ProxyAPIError, ProxyControl, SessionClient
from pipeline.proxy.sessions import SessionEnd
from schemas.trajectory import TrajectoryRow, validate_row

ADMIN = "admin"


@pytest.fixture
async def proxy(tiny_model_dir: Path, hf_engine_url: Any, start_proxy: Any) -> Any:
    return await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir), admin_key=ADMIN, require_capacity=True,
                             max_tokens_limit=4, client_keys=["client-a"])  # fmt: skip


@pytest.fixture
async def http() -> Any:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


def _subscribe(proxy: Any) -> list[SessionEnd]:
    seen: list[SessionEnd] = []

    async def hook(event: SessionEnd) -> None:
        seen.append(event)

    proxy.store.on_end(hook)
    return seen


async def _chat(http: httpx.AsyncClient, url: str, key: str) -> dict[str, Any]:
    r = await http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kind", ["local", "http"])
async def test_both_controls_drive_a_session_to_typed_rows(proxy: Any, http: httpx.AsyncClient, kind: str) -> None:
    control: ProxyControl = proxy.control if kind == "local" else HttpControl(proxy.url, ADMIN, http)
    seen = _subscribe(proxy)
    with pytest.raises(NoCapacity) as refused:
        await control.start_session("g")
    assert refused.value.status == 429
    await control.grant_capacity(1)
    info = await control.start_session("g", {"index": 3})
    reply = await _chat(http, proxy.url, info.api_key)
    refused_call = await http.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {info.api_key}"},
        json={"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    )
    assert refused_call.status_code == 400
    with pytest.raises(ProxyAPIError) as unknown:
        await control.set_reward(info.session_id, 1.0, "chatcmpl-nope")
    assert unknown.value.status == 404
    await control.set_reward(info.session_id, 0.5, reply["id"])
    await control.end_session(info.session_id, "rejected")
    assert seen == [SessionEnd(info.session_id, "end_session", "rejected")]

    exported = await control.export(info.session_id, style="concat", discount=1.0)
    assert (exported.session_id, exported.group_id, exported.num_interactions) == (info.session_id, "g", 1)
    assert exported.last_refusal is not None and exported.last_refusal.startswith("400: ")
    assert "temperature" in exported.last_refusal, "the session keeps what its refused call was told"
    (row,) = exported.rows
    assert isinstance(row, TrajectoryRow) and row.step is None and row.sample_id == reply["id"]
    assert row.reward == 0.5 and row.session_id == info.session_id and '"index": 3' in row.metadata
    validate_row(row.at_step(7))
    with pytest.raises(ProxyAPIError) as gone:
        await control.export(info.session_id, style="concat", discount=1.0)
    assert gone.value.status == 410, "an exported session is forgotten"


async def test_the_run_status_header_reaches_the_end_subscribers(proxy: Any, http: httpx.AsyncClient) -> None:
    seen = _subscribe(proxy)
    client = HttpControl(proxy.url, "client-a", http)
    await proxy.control.grant_capacity(3)
    failed, rejected, plain = [await client.start_session() for _ in range(3)]
    await SessionClient(proxy.url, failed, http).end("failed")
    headers = {"Authorization": f"Bearer {rejected.api_key}", "x-arl-run-status": "rejected"}
    r = await http.post(f"{proxy.url}/rl/v1/finalize", json={"final_reward": None}, headers=headers)
    assert r.status_code == 200, r.text
    await client.end_session(plain.session_id, "something else")  # any other value: the run ended well
    assert seen == [SessionEnd(failed.session_id, "end_session", "failed"),
                    SessionEnd(rejected.session_id, "finalize", "rejected"),
                    SessionEnd(plain.session_id, "end_session", "ok")]  # fmt: skip
    with pytest.raises(ProxyAPIError) as no_export:
        await client.export(plain.session_id, style="concat", discount=1.0)
    assert no_export.value.status == 403, "a client key never exports"
