"""arl's engine servers speak no more than SGLang does: every route of the engine app (both backends serve
the same table) is a route of SGLang 0.5.23's own app, with the same methods, read from `.sglang-venv`
through `sglang_judge.py routes`. So a client that works against arl's servers cannot lean on a path a
real SGLang server answers with 404 (as `/get_weight_version` once was).

Skipped with a reason when `.sglang-venv` is absent (build it with scripts/sglang_venv.sh; CI does).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from fastapi.routing import APIRoute

from pipeline.engine.inference.procs import REPO_ROOT
from pipeline.engine.server.app import build_app

SGLANG_PYTHON = REPO_ROOT / ".sglang-venv" / "bin" / "python"
JUDGE = Path(__file__).with_name("sglang_judge.py")
FASTAPI_OWN = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no .sglang-venv: build it with scripts/sglang_venv.sh"),
]


def sglang_routes() -> set[tuple[str, str]]:
    done = subprocess.run([str(SGLANG_PYTHON), "-W", "ignore", str(JUDGE), "routes"], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    table = json.loads(done.stdout.strip().splitlines()[-1])
    return {(r["path"], m) for r in table["routes"] for m in r["methods"]}


def arl_routes() -> set[tuple[str, str]]:
    """The engine app's routes; the backend is never called while the table is built."""
    app = build_app(object(), title="routes")  # type: ignore[arg-type]
    return {(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}


def test_every_route_of_arls_engine_is_an_sglang_route() -> None:
    ours = {(path, method) for path, method in arl_routes() if path not in FASTAPI_OWN}
    assert {("/model_info", "GET"), ("/begin_weight_update", "POST"), ("/end_weight_update", "POST")} <= ours
    extra = sorted(ours - sglang_routes())
    assert not extra, f"arl's engine serves routes SGLang 0.5.23 does not: {extra}"
