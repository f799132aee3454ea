"""Token-exact multi-turn through the real proxy, a real `hf` engine and the real `openai` SDK.

Between the proxy and the engine sits a recording relay (a loopback HTTP pass-through that keeps
the `input_ids` of every `/generate` body), so the test sees exactly what the engine was given.
The model is the tiny model with *scripted* weights (tests/conftest.py `_scripted_model`): real
forward passes that complete a named tool-call prefill into a valid call and end turns with the
end-of-turn token, so the conversation holds model-generated tool calls, agent-supplied tool calls
and reasoning in history, consecutive tool results, and the newline after `<|im_end|>`.

For every turn the engine's input equals the concat row's prefix, the loss mask covers exactly the
sampled tokens, and the row decodes to the template's rendering of the whole conversation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web

from pipeline.proxy.tokenize import ChatTokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip


class RecordingRelay:
    """Forwards the engine protocol to `upstream` and records each `/generate` request's input_ids."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.inputs: list[list[int]] = []

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.http = aiohttp.ClientSession()
        return f"http://127.0.0.1:{port}"

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/generate":
            self.inputs.append(json.loads(body)["input_ids"])
        async with self.http.request(request.method, self.upstream + request.path_qs, data=body,
                                     headers={"Content-Type": "application/json"}) as up:  # fmt: skip
            out = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def stop(self) -> None:
        await self.http.close()
        await self.runner.cleanup()


async def _session(url: str) -> tuple[str, str]:
    async with httpx.AsyncClient() as http:
        r = await http.post(url + "/rl/start_session", headers={"Authorization": "Bearer admin"})
        r.raise_for_status()
        return r.json()["session_id"], r.json()["api_key"]


async def _export(url: str, session_id: str, style: str = "concat") -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        r = await http.post(url + "/export_trajectories", headers={"Authorization": "Bearer admin"},
                            json={"session_id": session_id, "style": style, "discount": 1.0})  # fmt: skip
        r.raise_for_status()
        return r.json()


def _plain(message: Any) -> dict[str, Any]:
    """An SDK message as the agent would re-send it (exclude_none drops what the SDK leaves unset)."""
    return message.model_dump(exclude_none=True)


@pytest.mark.parametrize("template", ["qwen", "llama3"])
async def test_multi_turn_is_token_exact(template: str, request: pytest.FixtureRequest, hf_engine_url: Any,
                                         start_proxy: Any) -> None:  # fmt: skip
    model_dir: Path = request.getfixturevalue("scripted_qwen_dir" if template == "qwen" else "scripted_llama_dir")
    parser = "hermes" if template == "qwen" else "llama3_json"
    relay = RecordingRelay(hf_engine_url(model_dir))
    proxy = await start_proxy(model_dir, await relay.start(), model={"tool_parser": parser})
    try:
        session_id, key = await _session(proxy.url)
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=key)
        ask = {"model": "m", "tools": TOOLS, "temperature": 0, "max_tokens": 16}
        messages: list[Any] = [{"role": "system", "content": "You are a calculator."},
                               {"role": "user", "content": "What is 1 + 2?"}]  # fmt: skip
        # turn 1: a named tool choice; the model completes the call itself
        r1 = await client.chat.completions.create(messages=messages, tool_choice={"type": "function",
                                                  "function": {"name": "add"}}, **ask)  # fmt: skip
        assert r1.choices[0].finish_reason == "tool_calls"
        (call,) = r1.choices[0].message.tool_calls or []
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {})
        # turn 2: two consecutive tool results (the SDK's message object re-sent as is)
        messages += [r1.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "3"},
                     {"role": "tool", "tool_call_id": call.id, "content": "3, again"}]  # fmt: skip
        r2 = await client.chat.completions.create(messages=messages, **ask)
        assert r2.choices[0].finish_reason == "stop"
        # turn 3: history carries an agent-supplied assistant turn with reasoning and a tool call
        messages += [_plain(r2.choices[0].message), {"role": "user", "content": "And 20 + 22?"},
                     {"role": "assistant", "content": "Adding.", "reasoning_content": "Use the tool.",
                      "tool_calls": [{"id": "c9", "type": "function",
                                      "function": {"name": "add", "arguments": '{"a": 20, "b": 22}'}}]},
                     {"role": "tool", "tool_call_id": "c9", "content": "42"}]  # fmt: skip
        r3 = await client.chat.completions.create(messages=messages, **ask)
        messages += [r3.choices[0].message, {"role": "user", "content": "Thanks."}]
        r4 = await client.chat.completions.create(messages=messages, **ask)
        final_reply = _plain(r4.choices[0].message)

        data = await _export(proxy.url, session_id)
        assert data["num_interactions"] == 4 and data["prefix_breaks"] == 0
        (row,) = data["samples"]
        ids = row["input_ids"]
        assert row["num_turns"] == 4
        assert len(relay.inputs) == 4
        for turn, sent in enumerate(relay.inputs):
            assert ids[: len(sent)] == sent, f"turn {turn}: the engine's input is not the concat row's prefix"
        sampled = sum(r.usage.completion_tokens for r in (r1, r2, r3, r4) if r.usage)
        assert sum(row["loss_mask"]) == sampled
        for start in (len(s) for s in relay.inputs):
            assert row["loss_mask"][start] == 1 and row["loss_mask"][start - 1] == 0

        tok = ChatTokenizer(model_dir)
        rendered = tok.render([*[m if isinstance(m, dict) else _plain(m) for m in messages], final_reply], TOOLS,
                              add_generation_prompt=False)  # fmt: skip
        tail = tok.close_tail(ids)  # "\n" (qwen): after the final <|im_end|>, not sampled
        assert tok.decode(ids, skip_special_tokens=False) + tail == rendered
        if template == "qwen":
            assert tail == "\n" and rendered.count("<|im_end|>\n<|im_start|>") >= 6
    finally:
        await relay.stop()


async def test_edited_history_starts_a_new_concat_row(scripted_qwen_dir: Path, hf_engine_url: Any,
                                                      start_proxy: Any) -> None:  # fmt: skip
    proxy = await start_proxy(scripted_qwen_dir, hf_engine_url(scripted_qwen_dir))
    session_id, key = await _session(proxy.url)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=key)
    messages: list[Any] = [{"role": "user", "content": "Hello"}]
    r1 = await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=8)
    messages += [r1.choices[0].message, {"role": "user", "content": "Again"}]
    await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=8)
    edited = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "(summary of the chat)"},
              {"role": "user", "content": "Go on"}]  # fmt: skip
    await client.chat.completions.create(model="m", messages=edited, temperature=0, max_tokens=8)
    data = await _export(proxy.url, session_id)
    assert data["prefix_breaks"] == 1
    rows = data["samples"]
    assert [r["num_turns"] for r in rows] == [2, 1]
    assert json.loads(rows[1]["metadata"])["prefix_break"] is True
    tok = ChatTokenizer(scripted_qwen_dir)
    assert tok.decode(rows[1]["input_ids"], False).startswith(tok.render(edited, None, add_generation_prompt=True))
