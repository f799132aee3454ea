"""Schemathesis against the proxy's own OpenAPI schema, every operation, valid and invalid inputs,
with every kind of key: zero 5xx, zero hangs, every answer as documented (Schemathesis' status-code,
content-type and response-schema conformance checks) and every error in the API's JSON error shape.

The proxy is its own process (the `benchmarks/proxy_load.py` harness) in front of a real `hf` engine
process; completions are capped at 3 tokens (`proxy.max_tokens_limit`) so thousands of cases stay
fast. Case counts: `ARL_FUZZ_EXAMPLES` per operation and generation mode (default 60: ~1,700 cases).
A case that fails is printed by Hypothesis with its body, so it can be replayed by hand.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from threaded_proxy import WORKERS, ThreadedProxy  # tests/integration is on sys.path (pytest)

EXAMPLES = int(os.environ.get("ARL_FUZZ_EXAMPLES", str(60 * int(os.environ.get("ARL_FUZZ_SCALE", "1")))))
KEY_KINDS = ("none", "wrong", "admin", "client", "session")
TIMEOUT_S = 60.0  # per request: a hang fails the case


@dataclass
class Target:
    url: str
    admin: str
    client: str
    schema: Any
    other: str | None = None
    """Another worker of the target's pool, whose session keys the target must answer 421 (None: no pool)."""


@pytest.fixture(scope="module", params=WORKERS, ids=[f"workers{w}" for w in WORKERS])
def target(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Iterator[Target]:  # fmt: skip
    import schemathesis

    from benchmarks import proxy_load as harness

    work = tmp_path_factory.mktemp("fuzz_proxy")
    admin, client = "arl-admin-" + secrets.token_urlsafe(12), "client-" + secrets.token_urlsafe(12)
    engine_url, engine = harness.start_engine(tiny_model_dir, work / "engine.log")
    if request.param > 1:  # a pool (`make fuzz`): fuzz worker 0, with worker 1's session keys among the keys
        pool = ThreadedProxy(tiny_model_dir, engine_url, request.param).start()
        raw = httpx.get(f"{pool.url}/openapi.json", timeout=30).json()
        yield Target(pool.url, "admin", "fuzz-client", schemathesis.openapi.from_dict(raw), other=pool.urls[1])
        pool.stop()
        engine.terminate()
        engine.wait(timeout=30)
        return
    os.environ["ARL_LOAD_PROXY_CONFIG"] = json.dumps({"max_tokens_limit": 3, "max_request_bytes": 65536})
    try:
        url, proxy = harness.start_proxy(tiny_model_dir, engine_url, work / "proxy.log", admin_key=admin,
                                         client_keys=[client])  # fmt: skip
    finally:
        del os.environ["ARL_LOAD_PROXY_CONFIG"]
    raw = httpx.get(f"{url}/openapi.json", timeout=30).json()
    raw["paths"] = {p: v for p, v in raw["paths"].items() if not p.startswith("/_load")}  # the harness's own route
    yield Target(url, admin, client, schemathesis.openapi.from_dict(raw))
    for proc in (proxy, engine):
        proc.terminate()
        proc.wait(timeout=30)


def operations(target: Target) -> list[Any]:
    return [result.ok() for result in target.schema.get_all_operations()]


def key_for(target: Target, kind: str) -> str | None:
    if kind == "session" or kind == "foreign":
        url = target.other if kind == "foreign" and target.other else target.url
        reply = httpx.post(f"{url}/rl/start_session", headers={"Authorization": f"Bearer {target.admin}"},
                           timeout=TIMEOUT_S)  # fmt: skip
        assert reply.status_code == 200, reply.text
        return str(reply.json()["api_key"])
    return {"none": None, "wrong": "sk-wrong", "admin": target.admin, "client": target.client}[kind]


def check(case: Any, response: Any, label: str) -> None:
    """No 5xx (502/503 would mean the engine failed, which it must not here); the documented status, content
    type and body; errors are JSON objects."""
    from schemathesis.checks import (  # type: ignore[attr-defined]
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:500]}"
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                             response_schema_conformance])  # fmt: skip
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body, dict) and "error" in body, f"{label}: error body {response.text[:300]}"


def fuzz_operation(target: Target, operation: Any, generation: Any, http: Any, seen: dict[str, int]) -> Any:
    """A Hypothesis test over one operation's cases and key kinds (`@given` functions take no defaults)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    kinds = (*KEY_KINDS, "foreign") if target.other else KEY_KINDS

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=generation), kind=st.sampled_from(kinds))
    def fuzz(case: Any, kind: str) -> None:
        key = key_for(target, kind)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = case.call(base_url=target.url, session=http, headers=headers, timeout=TIMEOUT_S)
        seen[operation.label] = seen.get(operation.label, 0) + 1
        if os.environ.get("ARL_FUZZ_TRACE"):
            print(f"{time.strftime('%X')} {operation.label} {kind} -> {response.status_code} "
                  f"{float(response.elapsed):.2f}s", flush=True)  # fmt: skip
        check(case, response, f"{operation.label} ({kind} key)")

    return fuzz


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_proxy_schema_fuzz(target: Target, mode: str) -> None:
    import requests
    from schemathesis import GenerationMode

    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    seen: dict[str, int] = {}
    with requests.Session() as http:
        for operation in operations(target):
            if mode == "negative" and not operation.body and not operation.query:
                continue  # no body, no parameters: nothing to make invalid
            fuzz_operation(target, operation, generation, http, seen)()
    print(f"{mode}: {sum(seen.values())} cases over {len(seen)} operations: {seen}")
    assert len(seen) >= len(operations(target)) - 2, "every operation (with something to fuzz) was exercised"
    assert httpx.get(f"{target.url}/health", timeout=TIMEOUT_S).status_code == 200, "the proxy is still alive"


def test_valid_conversations_with_arbitrary_text_through_the_sdk(target: Target) -> None:
    """Schema-valid cases rarely form a conversation the proxy serves (most are 400s with a reason). Here
    Hypothesis builds conversations that *are* valid, with arbitrary Unicode text, stop strings, tools and
    sampling settings, and drives them through the real OpenAI SDK turn after turn: every call succeeds
    (the SDK raises on any error status), and the exported rows satisfy the shard schema."""
    import openai
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from schemas.trajectory import validate_row

    text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look something up",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    turn = st.fixed_dictionaries({"user": text, "stream": st.booleans(), "tools": st.booleans(),
                                  "temperature": st.none() | st.floats(0, 2), "top_p": st.none() | st.floats(0.01, 1),
                                  "stop": st.none() | st.lists(text.filter(bool), max_size=2)})  # fmt: skip

    @settings(max_examples=max(EXAMPLES // 2, 10), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(system=st.none() | text, turns=st.lists(turn, min_size=1, max_size=3))
    def conversation(system: str | None, turns: list[dict[str, Any]]) -> None:
        key = key_for(target, "session")
        assert key is not None
        client: Any = openai.OpenAI(base_url=f"{target.url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system is not None else []
        for t in turns:
            messages.append({"role": "user", "content": t["user"]})
            extra = {k: t[k] for k in ("temperature", "top_p", "stop") if t[k] is not None}
            if t["tools"]:
                extra["tools"] = [tool]
            if t["stream"]:
                parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model="m", messages=messages, max_tokens=3, stream=True, **extra) if c.choices]  # fmt: skip
                reply: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
            else:
                done = client.chat.completions.create(model="m", messages=messages, max_tokens=3, **extra)
                reply = done.choices[0].message.model_dump(exclude_none=True)
            messages.append(reply)
        exported = httpx.post(f"{target.url}/export_trajectories", timeout=TIMEOUT_S,
                              headers={"Authorization": f"Bearer {target.admin}"},
                              json={"session_id": key.split("-")[2], "style": "concat"})  # fmt: skip
        assert exported.status_code == 200, exported.text
        for row in exported.json()["samples"]:
            validate_row({**row, "step": 0, "created_at": row["created_at"]})

    conversation()
