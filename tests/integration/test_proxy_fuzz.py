"""Fuzz every proxy endpoint from the app's own OpenAPI schema (schemathesis): zero 5xx, zero hangs.

The proxy runs for real (uvicorn on loopback, a real `hf` engine behind it) in a background thread
with its own event loop, because schemathesis' generated tests are synchronous. Every answer is checked
against the document (Schemathesis' status-code, content-type and response-schema conformance). Each case carries
the right kind of key for its endpoint (a fresh session key for LLM and session calls, the admin
key for admin calls), so generated bodies reach the handlers instead of stopping at a 401.

Cases per endpoint and mode: `ARL_FUZZ_EXAMPLES` (default 40: ~640 cases, beside the ~1,700 of
test_fuzz_proxy.py; raise it for a deeper run), positive and negative (POST) generation modes.
A hang fails the case through the request timeout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (  # type: ignore[attr-defined]
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from threaded_proxy import WORKERS, ThreadedProxy  # tests/integration is on sys.path (pytest)

EXAMPLES = int(os.environ.get("ARL_FUZZ_EXAMPLES", str(40 * int(os.environ.get("ARL_FUZZ_SCALE", "1")))))
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ADMIN_PATHS = {"/grant_capacity", "/export_trajectories", "/rl/start_session"}


# With ARL_FUZZ_POOL=1 (`make fuzz`) every case also runs against a pool of two workers (`proxy.workers`): each
# session's calls go to its own worker, admin calls to the workers in turn.


@pytest.fixture(scope="module", params=WORKERS, ids=[f"workers{w}" for w in WORKERS])
def fuzz_proxy(tiny_model_dir: Path, hf_engine_url: Any, request: pytest.FixtureRequest) -> Iterator[ThreadedProxy]:
    proxy = ThreadedProxy(tiny_model_dir, hf_engine_url(tiny_model_dir), request.param).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_proxy: ThreadedProxy) -> Any:
    return schemathesis.openapi.from_dict(httpx.get(f"{fuzz_proxy.url}/openapi.json", timeout=30).json())


ENDPOINTS = [
    ("GET", "/health"), ("GET", "/v1/models"), ("POST", "/grant_capacity"), ("POST", "/rl/start_session"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"), ("POST", "/v1/messages"),
    ("POST", "/rl/set_reward"), ("POST", "/rl/end_session"), ("POST", "/export_trajectories"),
    ("POST", "/rl/v1/set_reward"), ("POST", "/rl/v1/finalize"),
]  # fmt: skip


def _key_for(path: str, proxy: ThreadedProxy) -> tuple[str, str]:
    """The key for a case of `path` and the URL to send it to (a session's calls go to its own worker)."""
    url = proxy.next_url()
    if path in ADMIN_PATHS:
        return "admin", url
    r = httpx.post(url + "/rl/start_session", headers={"Authorization": "Bearer admin"}, timeout=30)
    r.raise_for_status()
    return r.json()["api_key"], url


def test_every_endpoint_is_fuzzed(fuzz_schema: Any) -> None:
    documented = {(method.upper(), path) for path, ops in fuzz_schema.raw_schema["paths"].items() for method in ops}
    assert documented == set(ENDPOINTS)


# Negative cases need something to break: endpoints without a body or parameters have none.
CASES = [(m, p, mode) for m, p in ENDPOINTS for mode in (["positive", "negative"] if m == "POST" else ["positive"])]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_no_5xx_and_no_hang(method: str, path: str, mode: str, fuzz_proxy: ThreadedProxy, fuzz_schema: Any) -> None:
    operation = fuzz_schema[path][method]
    strategy = operation.as_strategy(generation_mode=GenerationMode(mode))
    seen: list[int] = []

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=SUPPRESSED)
    def run(case: Any) -> None:
        key, url = _key_for(path, fuzz_proxy)
        response = case.call(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500, f"{method} {path} -> {response.status_code}: {response.text[:500]}"
        case.validate_response(response, checks=CONFORMANCE)  # status, content type and body as documented
        if response.status_code >= 400:
            body = response.json()
            assert "error" in body and body["error"]["message"], body

    run()
    assert seen, "no case was generated"
