"""Proxy HTTP behaviour against a real `hf` engine: keys and isolation, session lifecycle, capacity,
rewards and export, and bad input (always a 4xx in the API's own error shape, never a 5xx)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

ADMIN = {"Authorization": "Bearer admin"}
CHAT = "/v1/chat/completions"


def _key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def proxy(tiny_model_dir: Path, hf_engine_url: Any, start_proxy: Any) -> Any:
    return await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir), client_keys=["client-a", "client-b"],
                             max_tokens_limit=4, max_request_bytes=4096)  # fmt: skip


@pytest.fixture
async def http(proxy: Any) -> Any:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as client:
        yield client


async def _start(http: httpx.AsyncClient, headers: dict[str, str] = ADMIN, **body: Any) -> dict[str, Any]:
    r = await http.post("/rl/start_session", headers=headers, json=body or None)
    assert r.status_code == 200, r.text
    return r.json()


async def _chat(http: httpx.AsyncClient, key: str, content: str = "hi", **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    return await http.post(CHAT, headers=_key(key), json=body)


async def test_keys_and_isolation(http: httpx.AsyncClient) -> None:
    a, b = await _start(http), await _start(http)
    assert (await _chat(http, a["api_key"])).status_code == 200
    assert (await _chat(http, b["api_key"])).status_code == 200
    # a session key acts on its own session only, and never exports
    r = await http.post("/rl/set_reward", headers=_key(a["api_key"]), json={"reward": 1, "session_id": b["session_id"]})
    assert r.status_code == 403
    r = await http.post("/export_trajectories", headers=_key(a["api_key"]), json={"session_id": a["session_id"]})
    assert r.status_code == 403 and a["api_key"] not in r.text
    assert (await http.post("/rl/start_session", headers=_key(a["api_key"]))).status_code == 403
    # x-api-key works like Bearer; a tampered session key is refused without saying whose it was
    assert (await http.post(CHAT, headers={"x-api-key": a["api_key"]}, json={"messages": [
        {"role": "user", "content": "x"}], "max_tokens": 1})).status_code == 200  # fmt: skip
    forged = a["api_key"][:-3] + "xyz"
    r = await _chat(http, forged)
    assert r.status_code == 401 and forged not in r.text and a["session_id"] not in r.text
    assert (await http.post(CHAT, json={})).status_code == 401
    # client keys: start and reward their own sessions; others' sessions look absent; no export
    mine = await _start(http, _key("client-a"))
    assert (await _chat(http, mine["api_key"])).status_code == 200
    own = {"reward": 0.5, "session_id": mine["session_id"]}
    ok = await http.post("/rl/set_reward", headers=_key("client-a"), json=own)
    assert ok.status_code == 200, ok.text
    for sid in (a["session_id"], mine["session_id"]):
        key = "client-b" if sid == mine["session_id"] else "client-a"
        r = await http.post("/rl/set_reward", headers=_key(key), json={"reward": 1, "session_id": sid})
        assert r.status_code == 404, r.text
    r = await http.post("/export_trajectories", headers=_key("client-a"), json={"session_id": mine["session_id"]})
    assert r.status_code == 403
    # a Responses id of another session is not visible
    r1 = await http.post("/v1/responses", headers=_key(a["api_key"]), json={"input": "hi", "max_output_tokens": 1})
    r = await http.post("/v1/responses", headers=_key(b["api_key"]),
                        json={"input": "more", "previous_response_id": r1.json()["id"]})  # fmt: skip
    assert r.status_code == 404


async def test_lifecycle_end_export_and_capacity(tiny_model_dir: Path, hf_engine_url: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir), require_capacity=True, max_sessions=2,
                              session_timeout_s=0.3)  # fmt: skip
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as http:
        r = await http.post("/rl/start_session", headers=ADMIN)
        assert r.status_code == 429 and "grant_capacity" in r.json()["error"]["message"]
        assert (await http.post("/grant_capacity", headers=ADMIN, json={"count": 5})).json() == {"available": 5}
        s1, s2 = await _start(http), await _start(http)
        r = await http.post("/rl/start_session", headers=ADMIN)
        assert r.status_code == 429 and "max_sessions" in r.json()["error"]["message"]
        assert (await _chat(http, s1["api_key"])).status_code == 200
        assert (await http.post("/rl/end_session", headers=_key(s1["api_key"]))).status_code == 200
        r = await _chat(http, s1["api_key"])
        assert r.status_code == 410 and r.json()["error"]["code"] == "session_ended"
        # rewards still land on an ended session; export removes it; its key then answers 410
        assert (await http.post("/rl/set_reward", headers=_key(s1["api_key"]), json={"reward": 2})).status_code == 200
        r = await http.post("/export_trajectories", headers=ADMIN, json={"session_id": s1["session_id"]})
        assert r.status_code == 200 and r.json()["samples"][0]["reward"] == 2.0
        assert (await _chat(http, s1["api_key"])).status_code == 410
        r = await http.post("/export_trajectories", headers=ADMIN, json={"session_id": s1["session_id"]})
        assert r.status_code == 410
        # idle timeout: s2 is ended by the sweep, then a new session fits again
        await asyncio.sleep(1.0)
        assert (await _chat(http, s2["api_key"])).status_code == 410
        await _start(http)


async def test_rewards_discount_and_aliases(http: httpx.AsyncClient) -> None:
    s = await _start(http, group_id="g1", metadata={"index": 7})
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = (await http.post(CHAT, headers=_key(s["api_key"]), json={"messages": msgs, "max_tokens": 2})).json()
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "more"}]
    second = (await http.post(CHAT, headers=_key(s["api_key"]), json={"messages": msgs, "max_tokens": 2})).json()
    h = _key(s["api_key"])
    r = await http.post("/rl/set_reward", headers=h, json={"reward": 0.25, "interaction_id": first["id"]})
    assert r.status_code == 200
    r = await http.post("/rl/set_reward", headers=h, json={"reward": 1, "interaction_id": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = await http.post("/rl/v1/set_reward", headers=h, json={"completion_id": second["id"], "reward": 0.5})
    assert r.status_code == 200 and r.json()["interaction_ids"] == [second["id"]]
    r = await http.post("/rl/v1/finalize", headers=h, json={"final_reward": 1.0})
    assert r.status_code == 200 and r.json()["ended"] is True
    r = await http.post("/export_trajectories", headers=ADMIN,
                        json={"session_id": s["session_id"], "discount": 0.5, "style": "individual"})  # fmt: skip
    data = r.json()
    rows = {row["sample_id"]: row for row in data["samples"]}
    assert data["group_id"] == "g1" and data["num_interactions"] == 2
    assert rows[second["id"]]["reward"] == pytest.approx(1.0)  # finalize replaced 0.5 on the last completion
    assert rows[first["id"]]["reward"] == pytest.approx(0.25 + 0.5 * 1.0)
    assert rows[second["id"]]["parent_id"] == first["id"]
    assert json.loads(rows[first["id"]]["metadata"])["index"] == 7
    assert isinstance(rows[first["id"]]["created_at"], int) and "step" not in rows[first["id"]]


async def test_bad_input_is_a_4xx_in_each_apis_shape(http: httpx.AsyncClient) -> None:
    s = await _start(http)
    h = {**_key(s["api_key"]), "Content-Type": "application/json"}
    cases: list[tuple[str, Any, int, str]] = [
        (CHAT, b"{not json", 400, "not valid JSON"),
        (CHAT, b"[1, 2]", 400, "JSON object"),
        (CHAT, {"messages": "hi"}, 400, "messages"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
         "image_url"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
        (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "a user message needs content"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function",
                "function": {"name": "nope"}}, "tools": [{"type": "function", "function": {"name": "add"}}]}, 400,
         "nope"),
        (CHAT, {"messages": [{"role": "user", "content": "x" * 3000}]}, 400, "context"),
        (CHAT, {"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "max_request_bytes"),
        ("/v1/responses", {"input": [{"type": "computer_call"}]}, 400, "computer_call"),
        ("/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}, 404, "resp_nope"),
        ("/rl/set_reward", b'{"reward": NaN}', 400, "reward"),
        ("/rl/set_reward", {"reward": 1, "bogus": 2}, 400, "bogus"),
        ("/v1/nothing", {}, 404, "no endpoint"),
    ]  # fmt: skip
    for path, body, status, needle in cases:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await http.post(path, headers=h, content=payload)
        assert r.status_code == status, (path, body if isinstance(body, bytes) else str(body)[:80], r.text)
        error = r.json()["error"]
        assert needle in error["message"] and error["type"], (path, error)
    # Anthropic shape on /v1/messages, including FastAPI's own validation errors
    prefilled = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}
    unanswered = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "3"}]},
    ]
    for body, needle in (
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": prefilled}, "prefill"),
        ({"max_tokens": 5, "messages": unanswered}, "no tool_use block with that id"),
    ):
        r = await http.post("/v1/messages", headers={"x-api-key": s["api_key"]}, json=body)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert needle in r.json()["error"]["message"]
    assert (await http.get(CHAT, headers=h)).status_code == 405
    r = await http.post("/export_trajectories", headers=ADMIN, json={"session_id": "unknown"})
    assert r.status_code == 404
    # max_tokens beyond proxy.max_tokens_limit (4 here) is capped, not refused
    r = await _chat(http, s["api_key"], max_tokens=10_000, temperature=1.0)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


@pytest.mark.parametrize(("path", "field", "value", "neutral"), [
    (CHAT, "presence_penalty", 0.5, 0),
    (CHAT, "frequency_penalty", -1.0, 0.0),
    (CHAT, "logit_bias", {"42": 5}, {}),
    (CHAT, "response_format", {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                      "schema": {"type": "object"}}},
     {"type": "text"}),
    (CHAT, "response_format", {"type": "json_object"}, None),
    (CHAT, "reasoning_effort", "high", None),
    (CHAT, "parallel_tool_calls", False, True),
    ("/v1/responses", "text", {"format": {"type": "json_object"}}, {"format": {"type": "text"}}),
    ("/v1/responses", "reasoning", {"effort": "low"}, None),
    ("/v1/responses", "parallel_tool_calls", False, True),
    ("/v1/messages", "thinking", {"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}),
])  # fmt: skip
async def test_a_field_arl_cannot_honour_is_a_400_unless_neutral_or_ignored(
    tiny_model_dir: Path, hf_engine_url: Any, start_proxy: Any, path: str, field: str, value: Any, neutral: Any
) -> None:
    """Asked for a different distribution or output, the proxy refuses rather than silently sampling as if not
    asked; the value that changes nothing passes; `proxy.ignore_fields` drops the field on the operator's say."""
    engine = hf_engine_url(tiny_model_dir)
    strict = await start_proxy(tiny_model_dir, engine, max_tokens_limit=4)
    lenient = await start_proxy(tiny_model_dir, engine, max_tokens_limit=4, ignore_fields=[field])
    base = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    if path == "/v1/responses":
        base = {"model": "m", "max_output_tokens": 2, "input": "hi"}
    for proxy, body, status in ((strict, {**base, field: value}, 400), (strict, {**base, field: neutral}, 200),
                                (lenient, {**base, field: value}, 200)):  # fmt: skip
        async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as http:
            session = await _start(http)
            headers = {"x-api-key": session["api_key"]} if path == "/v1/messages" else _key(session["api_key"])
            r = await http.post(path, headers=headers, json=body)
        assert r.status_code == status, (field, body, r.text)
        if status == 400:
            message = r.json()["error"]["message"]
            assert message.startswith(f"{field}=") and "proxy.ignore_fields" in message, message
