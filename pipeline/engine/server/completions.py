"""`/generate`'s work: one finished answer per completion, or a completion's Server-Sent Events.

The app (`pipeline.engine.server.app`) parses and expands the request; this module drives the backend's
progress iterators and builds SGLang's response bodies (`requests.response`) from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pipeline.engine.server.backend import EngineBackend, Progress
from pipeline.engine.server.requests import Produced, PromptLogprobs, WorkItem, response, splice_top, top_entries
from pipeline.engine.tokens import TopEntry


async def complete(backend: EngineBackend, item: WorkItem, text_in_logprobs: bool) -> dict[str, Any]:
    """SGLang's response for one completion, once it has finished."""
    ids: list[int] = []
    logprobs: list[float] = []
    top: list[TopEntry] = []
    prompt: PromptLogprobs | None = None
    versions: list[int] = []
    cached = 0
    routed: str | None = None
    last = Progress([], [], backend.weight_version)
    async with contextlib.aclosing(backend.generate(item, stream=False)) as progress:
        async for last in progress:
            ids += last.new_ids
            logprobs += last.new_logprobs
            top += last.new_top
            versions += last.versions()
            prompt = prompt or last.prompt
            cached = max(cached, last.cached_tokens)
            routed = last.routed_experts or routed
    produced = Produced(
        output_ids=ids,
        logprobs=logprobs,
        finish=last.finish,
        weight_version=last.weight_version,
        top_logprobs=top,
        prompt_logprobs=prompt,
        versions=versions,
        cached_tokens=cached,
        routed_experts=routed,
    )
    return response(item, produced, backend.tokenizer, text_in_logprobs=text_in_logprobs)


async def events(backend: EngineBackend, item: WorkItem, text_in_logprobs: bool) -> AsyncIterator[str]:
    """SSE events like SGLang's: cumulative `output_ids`/`text`/logprobs (deltas with `incremental_stream`)."""
    chunks = _Chunks(item, backend.tokenizer, text_in_logprobs, backend.incremental_stream)
    async with contextlib.aclosing(backend.generate(item, stream=True)) as progress:
        async for event in progress:
            body = chunks.add(event)
            if body is not None:
                yield f"data: {body}\n\n"
    yield "data: [DONE]\n\n"


class _Chunks:
    """The JSON text of each streamed event of one completion.

    Each position's top logprobs are encoded once and spliced into every cumulative event
    (`requests.splice_top` says why). The scored prompt (if asked) is in every event from the first on,
    as SGLang's `meta_info.input_token_logprobs`.
    """

    def __init__(self, item: WorkItem, tokenizer: Any, text_in_logprobs: bool, incremental: bool) -> None:
        self.item, self.tokenizer, self.text_in_logprobs, self.incremental = (
            item,
            tokenizer,
            text_in_logprobs,
            incremental,
        )
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_json: list[str] = []
        self.prompt: PromptLogprobs | None = None
        self.versions: list[int] = []
        self.cached = 0

    def add(self, event: Progress) -> str | None:
        """The event's JSON text, or None when it carries neither tokens nor the finish."""
        start = len(self.ids)
        self.ids += event.new_ids
        self.logprobs += event.new_logprobs
        self.top_json += [json.dumps(e) for e in top_entries(event.new_top, self.tokenizer, self.text_in_logprobs)]
        self.prompt = self.prompt or event.prompt
        self.versions += event.versions()
        self.cached = max(self.cached, event.cached_tokens)
        if not event.new_ids and event.finish is None:
            return None
        produced = Produced(
            output_ids=self.ids,
            logprobs=self.logprobs,
            finish=event.finish,
            weight_version=event.weight_version,
            prompt_logprobs=self.prompt,
            versions=self.versions,
            cached_tokens=self.cached,
            routed_experts=event.routed_experts,
        )  # no top logprobs: each position's JSON is encoded once and spliced in below
        chunk = response(self.item, produced, self.tokenizer, text_in_logprobs=self.text_in_logprobs)
        meta = chunk["meta_info"]
        with_top = meta.pop("output_top_logprobs", None) is not None
        if self.incremental:
            chunk["output_ids"] = self.ids[start:]
            skip = self.item.params.skip_special_tokens
            chunk["text"] = self.tokenizer.decode(self.ids[start:], skip_special_tokens=skip)
            if "output_token_logprobs" in meta:
                meta["output_token_logprobs"] = meta["output_token_logprobs"][start:]
        body = json.dumps(chunk)
        if with_top:
            body = splice_top(body, self.top_json[start:] if self.incremental else self.top_json)
        return body


async def until_disconnect(request: Request, work: list[Any]) -> list[dict[str, Any]] | None:
    """The results of `work` (coroutines), or None if the client disconnected first (the work is cancelled)."""
    gathered = asyncio.ensure_future(asyncio.gather(*work))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if gathered in done:
        return list(gathered.result())
    gathered.cancel()  # closing the backends' iterators aborts the completions
    return None


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return
