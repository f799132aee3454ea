"""A session started with `sampling` (an evaluation's decoding) imposes it on every call, whatever the agent asks:
a real proxy before a real `hf` engine, driven by the OpenAI SDK, over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai

ASK = {"model": "m", "messages": [{"role": "user", "content": "Say something."}], "temperature": 1.5, "max_tokens": 8}


async def _start(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(url + "/rl/start_session", headers={"Authorization": "Bearer admin"}, json=body)


async def _replies(url: str, key: str, times: int) -> list[tuple[str, int]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    out = []
    for _ in range(times):
        reply = await client.chat.completions.create(**ASK)  # type: ignore[call-overload]
        out.append((reply.choices[0].message.content or "", reply.usage.completion_tokens))
    return out


async def test_a_sessions_sampling_wins_over_what_the_agent_asks(tiny_model_dir: Path, hf_engine_url: Any,
                                                                 start_proxy: Any) -> None:  # fmt: skip
    proxy = await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir))
    imposed = await _start(proxy.url, {"sampling": {"temperature": 0, "max_tokens": 3}})
    assert imposed.status_code == 200, imposed.text
    greedy = await _replies(proxy.url, imposed.json()["api_key"], 4)
    assert len(set(greedy)) == 1, f"greedy decoding gives one reply whatever temperature is asked: {greedy}"
    assert all(tokens <= 3 for _, tokens in greedy), "the imposed max_tokens caps what the agent asks (8)"
    free = await _start(proxy.url, {})
    sampled = await _replies(proxy.url, free.json()["api_key"], 4)
    assert len(set(sampled)) > 1, f"without an imposed sampling the agent's temperature 1.5 applies: {sampled}"
    assert any(tokens > 3 for _, tokens in sampled)


async def test_bad_sampling_is_a_400_naming_the_field(tiny_model_dir: Path, hf_engine_url: Any,
                                                      start_proxy: Any) -> None:  # fmt: skip
    proxy = await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir))
    for body, field in (({"sampling": {"temperature": -1}}, "temperature"), ({"sampling": {"top_p": 0}}, "top_p"),
                        ({"sampling": {"seed": 3}}, "seed")):  # fmt: skip
        reply = await _start(proxy.url, body)
        assert reply.status_code == 400 and field in reply.text, reply.text
