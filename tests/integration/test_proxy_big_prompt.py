"""One agent's huge prompt (a tool that returns a whole file) must not hold up every other session: a real proxy
before a real `hf` engine, over HTTP, in the test's own event loop (so a blocked loop would block the test too).

A prompt whose characters alone prove it longer than the context is refused before it is rendered; a large one
that might fit is rendered and tokenized in a worker thread, and the proxy answers other calls meanwhile."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

BIG = "tool output line 0123456789 abcdefghij\n"


async def _session(url: str) -> str:
    async with httpx.AsyncClient() as http:
        started = await http.post(url + "/rl/start_session", headers={"Authorization": "Bearer admin"}, json={})
    return str(started.json()["api_key"])


def _ask(content: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


async def test_a_prompt_longer_than_the_context_by_its_characters_is_refused_unrendered(
    tiny_model_dir: Path, hf_engine_url: Any, start_proxy: Any
) -> None:
    proxy = await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir), max_request_bytes=16 * 2**20)
    key = await _session(proxy.url)
    content = BIG * 200_000  # 7.8 MB, under the body limit
    async with httpx.AsyncClient(timeout=120) as http:
        refused = await http.post(proxy.url + "/v1/chat/completions", json=_ask(content),
                                  headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"the prompt holds {len(content)} characters, so at least" in error["message"]
    assert "model.max_context" in error["message"]


async def test_a_large_prompt_is_prepared_while_other_sessions_are_served(
    tiny_model_dir: Path, hf_engine_url: Any, start_proxy: Any
) -> None:
    # A context this large lets the character bound pass, so the prompt is rendered and tokenized in full
    # (about a million tokens: seconds of tokenizer work) before the real count refuses it.
    proxy = await start_proxy(tiny_model_dir, hf_engine_url(tiny_model_dir), model={"max_context": 400_000},
                              max_request_bytes=16 * 2**20)  # fmt: skip
    big_key, small_key = await _session(proxy.url), await _session(proxy.url)
    content = BIG * 60_000  # 2.3 MB
    async with httpx.AsyncClient(timeout=300) as http:
        big = asyncio.create_task(http.post(proxy.url + "/v1/chat/completions", json=_ask(content),
                                            headers={"Authorization": f"Bearer {big_key}"}))  # fmt: skip
        # Let the big request reach its preparation (its upload and parsing take milliseconds, its tokenization
        # seconds); were the event loop held by it, this sleep itself would end only after.
        await asyncio.sleep(1.0)
        health = await http.get(proxy.url + "/health")
        small = await http.post(proxy.url + "/v1/chat/completions", json=_ask("Say hi."),
                                headers={"Authorization": f"Bearer {small_key}"})  # fmt: skip
        served_first = not big.done()
        refused = await big
    assert health.status_code == 200 and small.status_code == 200, small.text
    assert served_first, "another session's call waited for the big prompt's tokenization"
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert "the prompt is" in refused.json()["error"]["message"], "refused by the real count, after tokenizing"


def test_a_long_text_encodes_to_the_same_ids_with_the_gil_released(tiny_model_dir: Path) -> None:
    from pipeline.proxy.tokenize import _GIL_FREE_CHARS, ChatTokenizer

    tok = ChatTokenizer(tiny_model_dir)
    text = BIG * (2 * _GIL_FREE_CHARS // len(BIG))  # past the threshold: `encode_batch`, not `encode`
    assert len(text) > _GIL_FREE_CHARS
    assert tok.encode(text) == list(tok.hf.backend_tokenizer.encode(text, add_special_tokens=False).ids)
