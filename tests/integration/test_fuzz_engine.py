"""Schemathesis against the engine protocol (SGLang's native endpoints) of a real `hf` server, from the
server's own `/openapi.json`: zero 5xx, zero hangs, and every answer as documented (Schemathesis' status-code,
content-type and response-schema conformance checks).

The document is narrowed here, test-side only, so positive cases stay cheap and really generate: token ids
in the vocabulary, short prompts, a few new tokens, `n` <= 3. The server's context is 64 tokens so no case
decodes for long, and its weight-group rendezvous times out after 2 s. `ARL_FUZZ_EXAMPLES` sets the case
count per operation (default 80, times `ARL_FUZZ_SCALE`).
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
ADMIN_PATHS = {"/abort_request", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
               "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
               "/update_weights_from_distributed", "/end_weight_update", "/get_weights_by_name",
               "/update_weight_version"}  # fmt: skip
LORA_PATHS = {"/load_lora_adapter", "/unload_lora_adapter"}
"""SGLang's LoRA routes refuse with its `LoRAUpdateOutput`: `success` false and an `error_message`."""


def narrowed(document: dict[str, Any]) -> dict[str, Any]:
    """The server's document with cheap positive cases (the server accepts more; the fuzz needs not try it)."""
    schemas = document["components"]["schemas"]
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 400}, "minItems": 1, "maxItems": 12}
    generate = schemas["GenerateReqInput"]["properties"]
    generate["input_ids"] = {"anyOf": [ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": 3}]}
    generate["text"] = {"type": "string", "maxLength": 40}
    sampling = schemas["SamplingParams"]["properties"]
    sampling["max_new_tokens"] = {"type": "integer", "minimum": 0, "maximum": 8}
    sampling["n"] = {"type": "integer", "minimum": 1, "maximum": 3}
    schemas["InitWeightsUpdateGroupReqInput"]["properties"]["master_address"] = {"enum": ["127.0.0.1"]}
    return document


def test_the_engine_document_is_valid_openapi(engine: str) -> None:
    import schemathesis

    reply = httpx.get(f"{engine}/openapi.json", timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text[:300]
    schema = schemathesis.openapi.from_dict(reply.json())
    schema.validate()  # the OpenAPI 3.1 meta-schema
    operations = [op for item in reply.json()["paths"].values() for op in item.values()]
    ids = [op["operationId"] for op in operations]
    assert len(ids) == len(set(ids)), f"duplicate operationIds: {sorted(ids)}"
    assert not [op for op in operations if "422" in op["responses"]], "the engine answers 400, never 422"
    generate = reply.json()["paths"]["/generate"]["post"]
    assert generate["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/GenerateReqInput")
    assert "text/event-stream" in generate["responses"]["200"]["content"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    from pipeline.engine.server.hf.process import start_hf_server

    with start_hf_server(tiny_model_dir, max_context=64, weight_group_timeout_s=2.0) as handle:
        yield handle.url


def check(case: Any, response: Any, path: str) -> None:
    """No 5xx, the documented status, content type and body; errors in the route's own shape."""
    from schemathesis.checks import (  # type: ignore[attr-defined]
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    assert response.status_code < 500, f"{path}: {response.status_code} {response.text[:500]}"
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                             response_schema_conformance])  # fmt: skip
    if response.status_code >= 400 and path != "/flush_cache":  # flush_cache answers plain text, as SGLang
        body = response.json()
        if path in ADMIN_PATHS:
            assert body.get("success") is False and body.get("message"), f"{path}: {response.text[:300]}"
        elif path in LORA_PATHS:
            assert body.get("success") is False and body.get("error_message"), f"{path}: {response.text[:300]}"
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
        check(case, response, operation.path)

    return fuzz


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_engine_protocol_fuzz(engine: str, mode: str) -> None:
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(narrowed(httpx.get(f"{engine}/openapi.json", timeout=TIMEOUT_S).json()))
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
