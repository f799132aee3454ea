"""arl's engine servers speak no more than SGLang does: every route of the engine app (both backends serve
the same table) is a route of SGLang 0.5.23's own app, with the same methods, read from `.sglang-venv`
through `sglang_judge.py`'s `routes` (from the `answer` process it shares with test_sglang_contract:
conftest.py's `judge_json`). So a client that works against arl's servers cannot lean on a path a real SGLang
server answers with 404 (as `/get_weight_version` once was).

Skipped with a reason when `.sglang-venv` is absent (build it with scripts/sglang_venv.sh; CI does).
"""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from sglang_answers import SGLANG_PYTHON, JudgeJson  # tests/integration is on sys.path (pytest)

from pipeline.engine.server.app import build_app

FASTAPI_OWN = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no .sglang-venv: build it with scripts/sglang_venv.sh"),
]


def sglang_routes(judge_json: JudgeJson) -> set[tuple[str, str]]:
    table = judge_json("routes")
    return {(r["path"], m) for r in table["routes"] for m in r["methods"]}


def arl_routes() -> set[tuple[str, str]]:
    """The engine app's routes; the backend is never called while the table is built."""
    app = build_app(object(), title="routes")  # type: ignore[arg-type]
    return {(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}


def test_every_route_of_arls_engine_is_an_sglang_route(judge_json: JudgeJson) -> None:
    ours = {(path, method) for path, method in arl_routes() if path not in FASTAPI_OWN}
    assert {("/model_info", "GET"), ("/begin_weight_update", "POST"), ("/end_weight_update", "POST")} <= ours
    extra = sorted(ours - sglang_routes(judge_json))
    assert not extra, f"arl's engine serves routes SGLang 0.5.23 does not: {extra}"
