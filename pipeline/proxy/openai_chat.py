"""OpenAI Chat Completions: request -> `CallSpec`, completions -> response body or SSE chunks.

What is honoured: system/developer/user/assistant/tool messages (string or text-part content),
assistant `tool_calls` and `reasoning_content` in history, function `tools` with `tool_choice`
(auto / none / required / named, see docs/proxy.md for what required/named enforce), temperature,
top_p, top_k, max_tokens / max_completion_tokens, stop, n, seed, logprobs / top_logprobs (the
engine's top logprobs: the k most likely tokens of the distribution the sampled token's logprob
comes from; `top_logprobs` > 0 needs `logprobs: true`, as in OpenAI's API), stream with
`stream_options.include_usage`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pipeline.proxy.core import Completion, StreamItem, token_logprobs
from pipeline.proxy.errors import ApiError, bad_request
from pipeline.proxy.messages import Message, content_text, tool_call
from pipeline.proxy.parsers import Event
from pipeline.proxy.prepare import CallSpec
from pipeline.proxy.streaming import sse
from pipeline.proxy.tokenize import ChatTokenizer
from schemas.api.openai_chat import ChatCompletionRequest, ChatMessage


def new_ids(n: int) -> tuple[str, list[str]]:
    """The completion id and one interaction id per choice (the same id when n = 1)."""
    cid = "chatcmpl-" + uuid.uuid4().hex[:24]
    return cid, [cid] if n == 1 else [f"{cid}-{i}" for i in range(n)]


def to_spec(req: ChatCompletionRequest) -> CallSpec:
    if req.top_logprobs and not req.logprobs:
        raise bad_request(
            "top_logprobs needs logprobs: true (set logprobs to true to get the alternatives)", param="top_logprobs"
        )
    tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools or []]
    choice, name = "auto", None
    if isinstance(req.tool_choice, str):
        choice = req.tool_choice
    elif req.tool_choice is not None:
        choice, name = "named", req.tool_choice.function.name
    return CallSpec(
        messages=[_message(m, i) for i, m in enumerate(req.messages)],
        tools=tools or None,
        tool_choice=choice,
        tool_name=name,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_list(),
        seed=req.seed,
        n=req.n or 1,
        api="chat",
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
    )


def _message(m: ChatMessage, i: int) -> Message:
    where = f"messages[{i}].content"
    role = "system" if m.role == "developer" else m.role
    if m.content is None and role != "assistant":  # as OpenAI: only an assistant turn may have none
        raise bad_request(
            f"{where}: a {m.role} message needs content (null is accepted only for an assistant "
            "message, e.g. one with tool_calls)",
            param="messages",
        )
    out: Message = {"role": role, "content": content_text(_parts(m.content), where)}
    if role == "assistant":
        if m.tool_calls:
            out["tool_calls"] = [
                tool_call(c.id or f"call_{i}_{k}", c.function.name, _arguments(c.function.arguments))
                for k, c in enumerate(m.tool_calls)
            ]
        reasoning = m.reasoning_content or (m.model_extra or {}).get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out["reasoning_content"] = reasoning
    elif role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
    elif m.tool_calls:
        raise bad_request(f"messages[{i}]: only assistant messages may carry tool_calls", param="messages")
    return out


def _parts(content: Any) -> Any:
    if isinstance(content, list):
        return [p.model_dump() if hasattr(p, "model_dump") else p for p in content]
    return content


def _arguments(arguments: str | dict[str, Any]) -> str:
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    return arguments


# ----------------------------------------------------------------------------- responses


def response_message(c: Completion) -> dict[str, Any]:
    p = c.parsed
    message: dict[str, Any] = {"role": "assistant", "content": p.content if (p.content or not p.tool_calls) else None}
    if p.tool_calls:
        message["tool_calls"] = [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in p.tool_calls
        ]
    if p.reasoning:
        message["reasoning_content"] = p.reasoning
    return message


def _logprobs(tokenizer: ChatTokenizer, c: Completion) -> dict[str, Any]:
    return {"content": token_logprobs(tokenizer, c), "refusal": None}


def finish(c: Completion) -> dict[str, str]:
    """A choice's `finish_reason`, one of OpenAI's values (`Completion.arl_fields` says why abort is `length`)."""
    return {"finish_reason": "length" if c.truncated else c.finish_reason, **c.arl_fields()}


def usage(completions: list[Completion]) -> dict[str, int]:
    prompt = completions[0].prompt_tokens if completions else 0
    out = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


def response_body(
    cid: str, model: str, req: ChatCompletionRequest, completions: list[Completion], tokenizer: ChatTokenizer
) -> dict[str, Any]:
    choices = []
    for c in completions:
        logprobs = _logprobs(tokenizer, c) if req.logprobs else None
        choices.append({"index": c.index, "message": response_message(c), "logprobs": logprobs, **finish(c)})
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(completions),
        "system_fingerprint": None,
    }


async def stream_body(
    cid: str, model: str, req: ChatCompletionRequest, items: AsyncIterator[StreamItem], tokenizer: ChatTokenizer
) -> AsyncIterator[bytes]:
    """SSE chunks: a role chunk per choice, deltas as parsed, a finish chunk, usage, [DONE]."""
    chunks = _Chunks(cid, model, int(time.time()))
    n = req.n or 1
    for i in range(n):
        yield chunks.choice(i, {"role": "assistant", "content": ""})
    calls = [0] * n
    done: list[Completion] = []
    try:
        async for item in items:
            if item.done is not None:
                c = item.done
                done.append(c)
                logprobs = _logprobs(tokenizer, c) if req.logprobs else None
                yield chunks.choice(item.index, {}, c, logprobs)
                continue
            delta = _delta(item.event, calls, item.index)
            if delta is not None:
                yield chunks.choice(item.index, delta)
    except ApiError as exc:  # headers are out: report in-band, as OpenAI does
        yield sse(exc.openai_body())
        yield b"data: [DONE]\n\n"
        return
    if req.stream_options is not None and req.stream_options.include_usage:
        done.sort(key=lambda c: c.index)
        yield chunks.usage(done)
    yield b"data: [DONE]\n\n"


@dataclass(frozen=True)
class _Chunks:
    """The `chat.completion.chunk` events of one streamed completion."""

    cid: str
    """The completion's id, repeated in every chunk."""
    model: str
    """The served model's name."""
    created: int
    """When the stream started (seconds), the same in every chunk."""

    def choice(self, index: int, delta: dict[str, Any], done: Completion | None = None, logprobs: Any = None) -> bytes:
        """A chunk of choice `index`: its delta, and its finish reason once `done`."""
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            **(finish(done) if done is not None else {"finish_reason": None}),
        }
        return sse(self._chunk([choice]))

    def usage(self, completions: list[Completion]) -> bytes:
        """The last chunk when the client asked for usage: no choice, the call's token counts."""
        return sse({**self._chunk([]), "usage": usage(completions)})

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def _delta(event: Event | None, calls: list[int], index: int) -> dict[str, Any] | None:
    """The delta of a parser event of choice `index` (None: nothing to send); `calls` numbers each choice's tool
    calls."""
    assert event is not None
    if event.kind == "content":
        return {"content": event.text}
    if event.kind == "reasoning":
        return {"reasoning_content": event.text}
    if event.call is None:
        return None
    call = event.call
    delta = {
        "index": calls[index],
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    calls[index] += 1
    return {"tool_calls": [delta]}
