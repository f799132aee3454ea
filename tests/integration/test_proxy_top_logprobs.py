"""OpenAI `top_logprobs` through the real proxy and `hf` engine, with the real `openai` SDK: Chat
Completions (stream and not) and Responses (`include: ["message.output_text.logprobs"]`); bad values
are 400s in OpenAI's error shape; the recorded trajectory keeps the sampled tokens' logprobs only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

ASK: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Count: one two"}], "max_tokens": 8,
                       "temperature": 0, "logprobs": True, "top_logprobs": 3}  # fmt: skip


@pytest.fixture
async def proxy(tiny_model_dir: Path, hf_engine_url: Any, start_proxy: Any) -> Any:
    return await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir))


async def _session(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        r = await http.post(url + "/rl/start_session", headers={"Authorization": "Bearer admin"})
    assert r.status_code == 200, r.text
    return r.json()


async def _export(url: str, session_id: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as http:
        r = await http.post(url + "/export_trajectories", headers={"Authorization": "Bearer admin"},
                            json={"session_id": session_id, "style": "individual"})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["samples"]


def _check_alternatives(content: list[Any], k: int, greedy: bool) -> None:
    assert content, "no logprob entries"
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == k
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert all(t.bytes == list(t.token.encode("utf-8", errors="replace")) for t in top)
        if greedy:  # the generated token is the most likely one, with its own logprob
            assert (top[0].token, top[0].logprob) == (entry.token, pytest.approx(entry.logprob, abs=1e-6))


async def test_chat_top_logprobs_non_stream_and_stream(proxy: Any) -> None:
    s = await _session(proxy.url)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=s["api_key"])
    whole = await client.chat.completions.create(**ASK)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    _check_alternatives(content, 3, greedy=True)  # type: ignore[arg-type]
    stream = await client.chat.completions.create(**ASK, stream=True)
    streamed = [e async for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content or []]
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs])
        for e in content  # type: ignore[union-attr]
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)  # type: ignore[union-attr]
    # the recorded trajectory is unchanged: the sampled tokens' logprobs, nothing else
    rows = await _export(proxy.url, s["session_id"])
    assert len(rows) == 2 and set(rows[0]) == set(rows[1])
    sampled = [lp for lp, m in zip(rows[0]["logprobs"], rows[0]["loss_mask"], strict=True) if m]
    assert sampled[: len(content)] == pytest.approx([e.logprob for e in content], abs=1e-6)  # type: ignore[union-attr]
    assert not any("top" in key for key in rows[0])


async def test_chat_top_logprobs_with_sampling_and_n(proxy: Any) -> None:
    s = await _session(proxy.url)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=s["api_key"])
    r = await client.chat.completions.create(**{**ASK, "temperature": 1.0, "n": 2, "top_logprobs": 5, "seed": 3})
    for choice in r.choices:
        content = choice.logprobs.content  # type: ignore[union-attr]
        _check_alternatives(content, 5, greedy=False)  # type: ignore[arg-type]
        for entry in content:  # type: ignore[union-attr]
            listed = {t.token: t.logprob for t in entry.top_logprobs}
            # a token that is part of a UTF-8 character shows as U+FFFD, like other such tokens: skip those
            if entry.token in listed and "\ufffd" not in entry.token:
                assert listed[entry.token] == pytest.approx(entry.logprob, abs=1e-6)
    plain = await client.chat.completions.create(**{**ASK, "top_logprobs": 0})
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": None, "top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
    ],
)
async def test_bad_top_logprobs_are_openai_400s(proxy: Any, extra: dict[str, Any], param: str) -> None:
    s = await _session(proxy.url)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=s["api_key"], max_retries=0)
    body = {k: v for k, v in {**ASK, **extra}.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(**body)
    assert param in str(err.value.body)


async def test_responses_include_output_text_logprobs(proxy: Any) -> None:
    s = await _session(proxy.url)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=s["api_key"])
    ask: dict[str, Any] = {"model": "m", "input": "Count: one two", "max_output_tokens": 8, "temperature": 0,
                           "include": ["message.output_text.logprobs"], "top_logprobs": 2}  # fmt: skip
    r = await client.responses.create(**ask)
    (message,) = [o for o in r.output if o.type == "message"]
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs
    _check_alternatives(part.logprobs, 2, greedy=True)  # type: ignore[arg-type]
    events = [e async for e in await client.responses.create(**ask, stream=True)]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [(e.token, [t.token for t in e.top_logprobs or []]) for e in done.logprobs] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in part.logprobs
    ]
    final = events[-1].response.output  # type: ignore[union-attr]
    assert [e.token for e in final[0].content[0].logprobs] == [e.token for e in part.logprobs]  # type: ignore[union-attr]
    without = await client.responses.create(**{k: v for k, v in ask.items() if k != "include"})
    assert without.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(**{**ask, "top_logprobs": 21})
