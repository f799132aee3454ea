"""Security of the proxy: every endpoint × every kind of key, keys never logged or echoed, binding.

The proxy runs as its own process (the harness of `benchmarks/proxy_load.py`) at DEBUG log level in
front of a real `hf` engine process, so its whole log output can be searched for secrets. Every
cell of the matrix gets fresh sessions: A (started with client key 0, so "owner client" and "other
client" differ) and B (started by the admin). "other session" means B's key acting on A: where an
endpoint cannot name another session (LLM calls, finalize) the call succeeds on B, and the test then
checks A was left exactly as it was.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

KINDS = ("none", "wrong", "other_session", "session", "other_client", "owner_client", "admin")
# endpoint -> expected status per kind, in KINDS order
MATRIX: dict[str, tuple[int, ...]] = {
    "GET /health": (200, 200, 200, 200, 200, 200, 200),
    "GET /v1/models": (401, 401, 200, 200, 200, 200, 200),
    "POST /grant_capacity": (401, 401, 403, 403, 403, 403, 200),
    "POST /rl/start_session": (401, 401, 403, 403, 200, 200, 200),
    "POST /v1/chat/completions": (401, 401, 200, 200, 403, 403, 403),
    "POST /v1/responses": (401, 401, 200, 200, 403, 403, 403),
    "POST /v1/messages": (401, 401, 200, 200, 403, 403, 403),
    "POST /rl/set_reward": (401, 401, 403, 200, 404, 200, 200),
    "POST /rl/end_session": (401, 401, 403, 200, 404, 200, 200),
    "POST /export_trajectories": (401, 401, 403, 403, 403, 403, 200),
    "POST /rl/v1/set_reward": (401, 401, 404, 200, 403, 403, 403),
    "POST /rl/v1/finalize": (401, 401, 200, 200, 403, 403, 403),
}
NEEDS_COMPLETION = {"POST /rl/set_reward", "POST /rl/v1/set_reward"}


@dataclass
class Proxy:
    url: str
    admin: str
    clients: list[str]
    log: Path
    engine: subprocess.Popen[bytes]
    http: httpx.Client
    secrets_seen: set[str] = field(default_factory=set)
    bodies: list[tuple[str, int, str]] = field(default_factory=list)
    """(path, status, text) of every response: none may echo a key (a started session's own key excepted)."""


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    from benchmarks import proxy_load as harness

    work = tmp_path_factory.mktemp("security")
    admin = "arl-admin-" + secrets.token_urlsafe(18)
    clients = ["client-" + secrets.token_urlsafe(18) for _ in range(2)]
    engine_url, engine = harness.start_engine(tiny_model_dir, work / "engine.log")
    url, proc = harness.start_proxy(tiny_model_dir, engine_url, work / "proxy.log", admin_key=admin,
                                    client_keys=clients, log_level="DEBUG")  # fmt: skip
    handle = Proxy(url, admin, clients, work / "proxy.log", engine, httpx.Client(timeout=120), {admin, *clients})
    yield handle
    handle.http.close()
    for child in (proc, engine):
        if child.poll() is None:
            child.terminate()
        child.wait(timeout=30)


def call(proxy: Proxy, method: str, path: str, key: str | None, body: Any = None) -> httpx.Response:
    """One request; Anthropic's path gets the key as `x-api-key`, the rest as a bearer token."""
    headers = {}
    if key is not None:
        headers = {"x-api-key": key} if path == "/v1/messages" else {"Authorization": f"Bearer {key}"}
    response = proxy.http.request(method, proxy.url + path, headers=headers, json=body)
    proxy.bodies.append((path, response.status_code, response.text))
    return response


def start(proxy: Proxy, key: str) -> dict[str, str]:
    reply = call(proxy, "POST", "/rl/start_session", key, {})
    assert reply.status_code == 200, reply.text
    info = reply.json()
    proxy.secrets_seen.add(info["api_key"])
    return info


def chat(proxy: Proxy, key: str, text: str = "hello") -> httpx.Response:
    return call(proxy, "POST", "/v1/chat/completions", key,
                {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2})  # fmt: skip


def body_for(endpoint: str, a: dict[str, str], completion: str | None) -> Any:
    bodies: dict[str, Any] = {
        "POST /grant_capacity": {"count": 1},
        "POST /rl/start_session": {"group_id": "g"},
        "POST /v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "POST /v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 2},
        "POST /v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        "POST /rl/set_reward": {"session_id": a["session_id"], "reward": 1.0},
        "POST /rl/end_session": {"session_id": a["session_id"]},
        "POST /export_trajectories": {"session_id": a["session_id"]},
        "POST /rl/v1/set_reward": {"completion_id": completion, "reward": 1.0},
        "POST /rl/v1/finalize": {},
    }
    return bodies.get(endpoint)


@pytest.mark.parametrize("endpoint", list(MATRIX))
@pytest.mark.parametrize("kind", KINDS)
def test_endpoint_by_key_kind(proxy: Proxy, endpoint: str, kind: str) -> None:
    expected = MATRIX[endpoint][KINDS.index(kind)]
    a = start(proxy, proxy.clients[0])
    b = start(proxy, proxy.admin)
    completion = None
    if endpoint in NEEDS_COMPLETION:
        first = chat(proxy, a["api_key"])
        assert first.status_code == 200, first.text
        completion = first.json()["id"]
    key = {"none": None, "wrong": "sk-" + secrets.token_urlsafe(24), "other_session": b["api_key"],
           "session": a["api_key"], "other_client": proxy.clients[1], "owner_client": proxy.clients[0],
           "admin": proxy.admin}[kind]  # fmt: skip
    if key is not None:
        proxy.secrets_seen.add(key)
    method, path = endpoint.split(" ")
    reply = call(proxy, method, path, key, body_for(endpoint, a, completion))
    assert reply.status_code == expected, f"{endpoint} with a {kind} key: {reply.status_code} {reply.text[:300]}"
    if reply.status_code >= 400:
        assert reply.headers["content-type"].startswith("application/json")
        assert "error" in reply.json(), reply.text
    if reply.status_code == 401:
        assert "error" in reply.json() and reply.headers.get("www-authenticate") == "Bearer"
    if kind == "other_session":
        assert_untouched(proxy, a, interactions=1 if completion else 0)


def assert_untouched(proxy: Proxy, a: dict[str, str], interactions: int) -> None:
    """Session A is still open, with only its own interactions and no reward."""
    still_open = chat(proxy, a["api_key"], "still there?")
    assert still_open.status_code == 200, still_open.text
    exported = call(proxy, "POST", "/export_trajectories", proxy.admin, {"session_id": a["session_id"]})
    assert exported.status_code == 200, exported.text
    data = exported.json()
    assert data["num_interactions"] == interactions + 1
    assert all(row["reward"] == 0.0 for row in data["samples"])
    assert {row["session_id"] for row in data["samples"]} == {a["session_id"]}


def test_forged_and_ended_session_keys(proxy: Proxy) -> None:
    a = start(proxy, proxy.admin)
    forged = a["api_key"][: -len(a["api_key"].split("-")[-1])] + "x" * 32  # A's id, a wrong secret
    proxy.secrets_seen.add(forged)
    assert chat(proxy, forged).status_code == 401
    assert call(proxy, "POST", "/rl/end_session", a["api_key"]).status_code == 200
    ended = chat(proxy, a["api_key"])
    assert ended.status_code == 410 and ended.json()["error"]["code"] == "session_ended"
    assert call(proxy, "POST", "/export_trajectories", proxy.admin, {"session_id": a["session_id"]}).status_code == 200
    gone = chat(proxy, a["api_key"])
    assert gone.status_code == 410, gone.text
    # the same key kinds work in the other header, and a malformed Authorization header is a 401
    both = httpx.get(proxy.url + "/v1/models", headers={"x-api-key": proxy.admin}, timeout=30)
    assert both.status_code == 200
    odd = httpx.get(proxy.url + "/v1/models", headers={"Authorization": f"Basic {proxy.admin}"}, timeout=30)
    assert odd.status_code == 401
    proxy.bodies += [("/v1/models", both.status_code, both.text), ("/v1/models", odd.status_code, odd.text)]


def test_a_missing_key_is_401_even_with_a_body_that_is_not_json(proxy: Proxy) -> None:
    reply = proxy.http.post(proxy.url + "/rl/set_reward", content=b"not json",
                            headers={"Content-Type": "application/json"})  # fmt: skip
    assert reply.status_code == 401, reply.text


@pytest.mark.parametrize("endpoint", [e for e in MATRIX if e.startswith("POST ")])
def test_keys_are_checked_before_the_body_is_read(proxy: Proxy, endpoint: str) -> None:
    """No key, a wrong key or a key of the wrong kind is refused in the API's own shape, whatever the body."""
    path = endpoint.split(" ")[1]
    session = start(proxy, proxy.admin)["api_key"]
    proxy.secrets_seen.add(session)
    wrong = "sk-" + secrets.token_urlsafe(24)
    proxy.secrets_seen.add(wrong)
    expected = dict(zip(KINDS, MATRIX[endpoint], strict=True))
    for kind, key in (("none", None), ("wrong", wrong), ("session", session), ("admin", proxy.admin)):
        headers = {"Content-Type": "application/json"}
        if key is not None and path == "/v1/messages":
            headers["x-api-key"] = key
        elif key is not None:
            headers["Authorization"] = f"Bearer {key}"
        reply = proxy.http.post(proxy.url + path, content=b"{not json", headers=headers)
        proxy.bodies.append((path, reply.status_code, reply.text))
        want = expected[kind] if expected[kind] in (401, 403) else 400  # an accepted key reaches the JSON check
        assert reply.status_code == want, f"{endpoint} with a {kind} key: {reply.status_code} {reply.text[:300]}"
        data = reply.json()
        if path == "/v1/messages":
            assert data["type"] == "error" and data["error"]["type"] and data["error"]["message"], data
        else:
            assert data["error"]["type"] and data["error"]["message"], data
        if want == 400:
            assert "JSON" in data["error"]["message"], data


def other_addresses() -> list[str]:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return [a for a in out if ":" not in a and not a.startswith("127.")]


def refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return False
    except OSError:
        return True


def test_proxy_and_engine_bind_only_where_configured(proxy: Proxy, tiny_model_dir: Path, tmp_path: Path) -> None:
    others = other_addresses()
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address to connect through")
    port = int(proxy.url.rsplit(":", 1)[1])
    assert not refused("127.0.0.1", port)
    assert refused(others[0], port), f"the proxy configured for 127.0.0.1 accepts connections on {others[0]}"
    # and the other way round: bound to the other address, loopback is refused
    from benchmarks import proxy_load as harness

    engine_url, engine = harness.start_engine(tiny_model_dir, tmp_path / "engine.log")
    try:
        engine_port = int(engine_url.rsplit(":", 1)[1])
        assert refused(others[0], engine_port), "the hf engine bound to 127.0.0.1 accepts other addresses"
        url, proc = harness.start_proxy(tiny_model_dir, engine_url, tmp_path / "proxy.log", admin_key="a" * 20,
                                        host=others[0])  # fmt: skip
        try:
            other_port = int(url.rsplit(":", 1)[1])
            assert not refused(others[0], other_port)
            assert refused("127.0.0.1", other_port)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        engine.terminate()
        engine.wait(timeout=30)


def secret_of(key: str) -> str:
    """The part of a key that must stay secret (a session key's id part is not secret)."""
    return key[len("arl-sess-") + 17 :] if key.startswith("arl-sess-") else key


def test_keys_never_in_logs_or_error_bodies(proxy: Proxy) -> None:
    """Runs last in this file: the log then holds every earlier request of the module too."""
    a = start(proxy, proxy.clients[1])
    assert chat(proxy, a["api_key"]).status_code == 200
    # an engine failure is logged by the proxy: kill the engine (our child, by pid) and call again
    os.kill(proxy.engine.pid, 9)
    proxy.engine.wait(timeout=30)
    failed = chat(proxy, a["api_key"], "the engine is gone")
    assert failed.status_code in (502, 503), failed.text
    assert "error" in failed.json()
    log_text = proxy.log.read_text(errors="replace")
    assert "DEBUG" in log_text, "the proxy log was captured at DEBUG level"
    assert len(proxy.secrets_seen) > 4
    for key in proxy.secrets_seen:
        assert secret_of(key) not in log_text, "a key appears in the proxy's log"
        for path, status, text in proxy.bodies:
            if path == "/rl/start_session" and status == 200:
                continue  # the reply that hands out a session key
            assert secret_of(key) not in text, f"a key was echoed by {path} ({status})"


def test_a_client_that_hangs_up_mid_request_is_one_log_line_and_the_proxy_serves_on(proxy: Proxy) -> None:
    """A caller gone before its body arrived (an agent cancelled, a pool closing a connection): the proxy logs one
    line, not an 'unhandled error' traceback, and goes on serving."""
    import time

    session = start(proxy, proxy.clients[0])
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {session['api_key']}\r\n"
        "Content-Type: application/json\r\nContent-Length: 400\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(head.encode() + b'{"model": "m", "messages": [')  # and hang up, 372 bytes short
    deadline = time.monotonic() + 30
    while "the client hung up before its request was read" not in proxy.log.read_text():
        assert time.monotonic() < deadline, "the proxy never noticed the hang-up"
        time.sleep(0.1)
    assert "unhandled error" not in proxy.log.read_text()
    assert call(proxy, "GET", "/v1/models", session["api_key"]).status_code == 200  # (another test stops the engine)
