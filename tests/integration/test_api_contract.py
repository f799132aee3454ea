"""The servers describe themselves truthfully (issue 21, part 7): each finding of the outside Schemathesis run,
as a plain test against a real proxy and a real `hf` engine on loopback.

The proxy's document is valid OpenAPI and declares what the fuzz suites check it against; a 405 names the
allowed methods; types are refused, not coerced; answers validate against the installed openai and anthropic
SDK types (Responses usage included); an engine abort leaves the proxy as an API value, with arl's reason in
`arl_finish_reason`. (The engine's own document and strict types: test_fuzz_engine.py, test_engine_hf_server.py.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic.types
import httpx
import openai.types.chat
import openai.types.responses
import pytest

ADMIN = {"Authorization": "Bearer admin"}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def proxy(tiny_model_dir: Path, hf_engine_url: Any, start_proxy: Any) -> Any:
    return await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir))


async def _session(http: httpx.AsyncClient, url: str) -> dict[str, str]:
    reply = await http.post(url + "/rl/start_session", headers=ADMIN)
    assert reply.status_code == 200, reply.text
    return {"Authorization": f"Bearer {reply.json()['api_key']}", "x-api-key": reply.json()["api_key"]}


async def test_the_proxy_document_is_valid_and_complete(proxy: Any) -> None:
    import schemathesis

    async with httpx.AsyncClient() as http:
        reply = await http.get(proxy.url + "/openapi.json")
    assert reply.status_code == 200
    document = reply.json()
    schemathesis.openapi.from_dict(document).validate()  # the OpenAPI 3.1 meta-schema
    operations = {(m, p): op for p, item in document["paths"].items() for m, op in item.items()}
    ids = [op["operationId"] for op in operations.values()]
    assert len(ids) == len(set(ids))
    for (method, path), op in operations.items():
        assert "422" not in op["responses"], f"{path}: the proxy answers 400, never 422"
        assert op["responses"]["200"]["content"]["application/json"]["schema"], f"{path}: an empty 200 schema"
        if method == "post":
            assert "400" in op["responses"] and "413" in op["responses"], path
            assert "requestBody" in op, path
        if path != "/health":
            assert {"401", "403", "410"} <= set(op["responses"]), path
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert "text/event-stream" in operations["post", path]["responses"]["200"]["content"], path
    messages_error = operations["post", "/v1/messages"]["responses"]["400"]["content"]["application/json"]
    assert messages_error["schema"]["$ref"].endswith("/AnthropicError")


async def test_a_405_carries_allow(proxy: Any) -> None:
    async with httpx.AsyncClient() as http:
        public = await http.delete(proxy.url + "/health")
        keyed = await http.put(proxy.url + "/v1/chat/completions", headers=await _session(http, proxy.url))
    assert public.status_code == 405 and public.headers["allow"] == "GET", public.headers
    assert keyed.status_code == 405 and keyed.headers["allow"] == "POST", keyed.headers
    assert keyed.json()["error"]["message"] == "method PUT is not allowed on /v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": USER, "stream": 0}, "stream"),
        ("/v1/chat/completions", {"messages": USER, "temperature": False}, "temperature"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "logprobs": 1}, "logprobs"),
        ("/v1/responses", {"input": "hi", "stream": 0}, "stream"),
        ("/v1/responses", {"input": "hi", "top_p": True}, "top_p"),
        ("/v1/messages", {"messages": USER, "max_tokens": 2, "temperature": False}, "temperature"),
        ("/v1/messages", {"messages": USER, "max_tokens": 2.0}, "max_tokens"),
        ("/grant_capacity", {"count": True}, "count"),
        ("/rl/set_reward", {"reward": True}, "reward"),
        ("/export_trajectories", {"session_id": "x", "discount": False}, "discount"),
    ],
)
async def test_types_are_refused_not_coerced(proxy: Any, path: str, body: dict[str, Any], field: str) -> None:
    async with httpx.AsyncClient() as http:
        headers = ADMIN if path in ("/grant_capacity", "/export_trajectories", "/rl/set_reward") else None
        reply = await http.post(proxy.url + path, json=body, headers=headers or await _session(http, proxy.url))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert field in error["message"], error
    if path != "/v1/messages":
        assert error["param"] == field, error


async def test_integers_are_numbers(proxy: Any) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(proxy.url + "/v1/chat/completions", headers=await _session(http, proxy.url),
                                json={"messages": USER, "temperature": 1, "top_p": 1, "max_tokens": 2})  # fmt: skip
    assert reply.status_code == 200, reply.text


async def test_answers_validate_against_the_sdk_types(proxy: Any) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        keys = await _session(http, proxy.url)
        chat = await http.post(proxy.url + "/v1/chat/completions", headers=keys,
                               json={"messages": USER, "max_tokens": 2})  # fmt: skip
        responses = await http.post(proxy.url + "/v1/responses", headers=keys,
                                    json={"input": "hi", "max_output_tokens": 2})  # fmt: skip
        messages = await http.post(proxy.url + "/v1/messages", headers=keys, json={"messages": USER, "max_tokens": 2})
    openai.types.chat.ChatCompletion.model_validate(chat.json())
    usage = openai.types.responses.Response.model_validate(responses.json()).usage
    assert usage is not None and usage.input_tokens_details.cache_write_tokens == 0
    anthropic.types.Message.model_validate(messages.json())


CALLS = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 200}),
    "chat-stream": ("/v1/chat/completions", {"messages": USER, "max_tokens": 200, "stream": True}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 200}),
    "responses-stream": ("/v1/responses", {"input": "hi", "max_output_tokens": 200, "stream": True}),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 200}),
    "messages-stream": ("/v1/messages", {"messages": USER, "max_tokens": 200, "stream": True}),
}


async def _aborted(proxy: Any, engine: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """The answer of a call the engine aborts: held by a paused engine, then aborted, so it never finishes first."""
    async with httpx.AsyncClient(timeout=60) as http:
        keys = await _session(http, proxy.url)
        assert (await http.post(engine + "/pause_generation", json={"mode": "in_place"})).status_code == 200
        try:
            call = asyncio.create_task(http.post(proxy.url + path, headers=keys, json=body))
            for _ in range(600):
                load = (await http.get(engine + "/server_info")).json()
                if load["running"] + load["waiting"] >= 1:
                    break
                await asyncio.sleep(0.05)
            assert (await http.post(engine + "/abort_request", json={"abort_all": True})).status_code == 200
            return await call
        finally:
            await http.post(engine + "/continue_generation")


def _check_aborted_stream(api: str, events: list[dict[str, Any]]) -> None:
    if api == "chat-stream":
        last = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]
        for event in events:
            openai.types.chat.ChatCompletionChunk.model_validate(event)
        assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["arl_finish_reason"] == "abort"
    elif api == "responses-stream":
        final = openai.types.responses.ResponseIncompleteEvent.model_validate(events[-1])
        assert final.response.status == "incomplete" and events[-1]["response"]["arl_finish_reason"] == "abort"
    else:
        (delta,) = [e for e in events if e["type"] == "message_delta"]
        anthropic.types.RawMessageDeltaEvent.model_validate(delta)
        assert delta["delta"]["stop_reason"] == "max_tokens" and delta["delta"]["arl_finish_reason"] == "abort"


@pytest.mark.parametrize("api", sorted(CALLS))
async def test_an_engine_abort_leaves_as_an_api_value(proxy: Any, tiny_model_dir: Path, hf_engine_url: Any,
                                                      api: str) -> None:  # fmt: skip
    path, body = CALLS[api]
    reply = await _aborted(proxy, hf_engine_url(tiny_model_dir), path, body)
    assert reply.status_code == 200, reply.text
    if api.endswith("-stream"):
        _check_aborted_stream(api, [json.loads(line[6:]) for line in reply.text.splitlines()
                                    if line.startswith("data: {")])  # fmt: skip
        return
    data = reply.json()
    assert data["arl_finish_reason" if api != "chat" else "choices"] is not None
    if api == "chat":
        choice = openai.types.chat.ChatCompletion.model_validate(data).choices[0]
        assert choice.finish_reason == "length" and data["choices"][0]["arl_finish_reason"] == "abort"
    elif api == "responses":
        response = openai.types.responses.Response.model_validate(data)
        assert response.status == "incomplete" and data["arl_finish_reason"] == "abort"
        assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    else:
        message = anthropic.types.Message.model_validate(data)
        assert message.stop_reason == "max_tokens" and data["arl_finish_reason"] == "abort"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", {"input_ids": [[False]]}, "input_ids"),
        ("/generate", {"input_ids": [1, 2], "stream": 0}, "stream"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": False}}, "temperature"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2.0}}, "max_new_tokens"),
        ("/abort_request", {"abort_all": 1}, "abort_all"),
        ("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": True}, "truncate_size"),
    ],
)
async def test_the_engine_refuses_wrong_types(tiny_model_dir: Path, hf_engine_url: Any, path: str,
                                              body: dict[str, Any], field: str) -> None:  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(hf_engine_url(tiny_model_dir) + path, json=body)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"] if path == "/generate" else reply.json()["message"]
    assert field in message, message
