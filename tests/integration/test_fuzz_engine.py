"""Schemathesis against the engine protocol (SGLang's native endpoints) of a real `hf` server:
zero 5xx, zero hangs, every error a JSON object in SGLang's shape.

The hf server parses its bodies by hand (SGLang accepts loose JSON), so its FastAPI OpenAPI schema
says nothing about them; the schema here is built from the protocol models in `schemas/engine_api.py`
(the contract), with the sampling parameters typed and token ids kept in the vocabulary so that
positive cases really generate. The server's context is 64 tokens so no case decodes for long, and
its weight-group rendezvous times out after 2 s. `ARL_FUZZ_EXAMPLES` scales the case count.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

EXAMPLES = int(os.environ.get("ARL_FUZZ_EXAMPLES", str(80 * int(os.environ.get("ARL_FUZZ_SCALE", "1")))))
TIMEOUT_S = 60.0
GETS = ["/health", "/health_generate", "/model_info", "/server_info", "/get_model_info", "/get_server_info"]
ADMIN_PATHS = {"/abort_request", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
               "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
               "/update_weights_from_distributed", "/end_weight_update", "/flush_cache"}  # fmt: skip


def protocol_schema() -> dict[str, Any]:
    """An OpenAPI 3.1 document for the engine endpoints, from the protocol's pydantic models."""
    from pydantic.json_schema import models_json_schema

    from schemas import engine_api as api

    bodies = {"/generate": api.GenerateReqInput, "/abort_request": api.AbortReq,
              "/pause_generation": api.PauseGenerationReqInput,
              "/update_weights_from_disk": api.UpdateWeightFromDiskReqInput,
              "/init_weights_update_group": api.InitWeightsUpdateGroupReqInput,
              "/destroy_weights_update_group": api.DestroyWeightsUpdateGroupReqInput,
              "/begin_weight_update": api.BeginWeightUpdateReqInput,
              "/update_weights_from_distributed": api.UpdateWeightsFromDistributedReqInput,
              "/end_weight_update": api.EndWeightUpdateReqInput}  # fmt: skip
    models: list[Any] = [(m, "validation") for m in (*bodies.values(), api.SamplingParams)]
    _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 400}, "minItems": 1, "maxItems": 12}
    generate = schemas["GenerateReqInput"]["properties"]
    generate["input_ids"] = {"anyOf": [ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": 3}]}
    generate["sampling_params"] = {"$ref": "#/components/schemas/SamplingParams"}
    generate["text"] = {"type": "string", "maxLength": 40}
    sampling = schemas["SamplingParams"]["properties"]
    sampling["max_new_tokens"] = {"type": "integer", "minimum": 0, "maximum": 8}
    sampling["n"] = {"type": "integer", "minimum": 1, "maximum": 3}
    schemas["InitWeightsUpdateGroupReqInput"]["properties"]["master_address"] = {"enum": ["127.0.0.1"]}
    ok = {"200": {"description": "ok"}}
    paths: dict[str, Any] = {p: {"get": {"responses": ok}} for p in GETS}
    for path, model in bodies.items():
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
        paths[path] = {"post": {"requestBody": {"required": True, "content": content}, "responses": ok}}
    paths["/continue_generation"] = {"post": {"responses": ok}}
    paths["/flush_cache"] = {"post": {"responses": ok}}
    return {"openapi": "3.1.0", "info": {"title": "engine protocol", "version": "1"}, "paths": paths,
            "components": {"schemas": schemas}}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.server.hf import start_hf_server

    with start_hf_server(tiny_model_dir, max_context=64, weight_group_timeout_s=2.0) as handle:
        yield handle.url


def check(response: Any, path: str) -> None:
    assert response.status_code < 500, f"{path}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        if path in ADMIN_PATHS:
            assert body.get("success") is False and body.get("message"), f"{path}: {response.text[:300]}"
        else:
            error = body.get("error")
            assert isinstance(error, dict) and error.get("message"), f"{path}: {response.text[:300]}"


def fuzz_operation(operation: Any, generation: Any, engine: str, http: Any, seen: dict[str, int]) -> Any:
    """A Hypothesis test over one operation's cases (a factory: `@given` functions take no defaults)."""
    from hypothesis import HealthCheck, given, settings

    # A valid group request waits for a rendezvous that never comes (2 tries x 2 s): a few suffice.
    examples = min(EXAMPLES, 8) if operation.path == "/init_weights_update_group" else EXAMPLES

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=generation))
    def fuzz(case: Any) -> None:
        try:
            response = case.call(base_url=engine, session=http, timeout=TIMEOUT_S)
        finally:
            if operation.path == "/pause_generation":  # a paused server holds /generate: resume it
                http.post(f"{engine}/continue_generation", timeout=TIMEOUT_S)
        seen[operation.label] = seen.get(operation.label, 0) + 1
        check(response, operation.path)

    return fuzz


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_engine_protocol_fuzz(engine: str, mode: str) -> None:
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(protocol_schema())
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    seen: dict[str, int] = {}
    with requests.Session() as http:
        for result in schema.get_all_operations():
            operation = result.ok()  # type: ignore[union-attr]
            if mode == "negative" and not operation.body:
                continue  # no body, no parameters: nothing to make invalid

            fuzz_operation(operation, generation, engine, http, seen)()
    print(f"{mode}: {sum(seen.values())} cases: {seen}")
    alive = httpx.post(f"{engine}/generate", timeout=TIMEOUT_S,
                       json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
    assert alive.status_code == 200 and len(alive.json()["output_ids"]) <= 2, "the server still generates"
