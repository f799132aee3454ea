"""Anthropic Messages API: content blocks <-> normalised messages, response and stream events.

Blocks understood: `text`, `tool_use` (assistant), `tool_result` (user; string or text blocks),
`thinking` (assistant; becomes reasoning) and `redacted_thinking` (dropped: there is no text).
Images and documents get a 400 (the policy reads text). `tool_choice`: auto, any (= required),
tool (= named), none. A final assistant message (Anthropic's "prefill") is refused with a 400.
Errors use Anthropic's shape `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response, StreamingResponse

from pipeline.proxy.core import Completion, Generator
from pipeline.proxy.errors import ApiError, bad_request
from pipeline.proxy.http import json_response
from pipeline.proxy.messages import Message, content_text, tool_call
from pipeline.proxy.parsers import Event
from pipeline.proxy.prepare import CallSpec
from pipeline.proxy.sessions import Session
from pipeline.proxy.streaming import SSE_HEADERS, sse
from schemas.api.anthropic import AnthropicMessage, Block, MessagesRequest

_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "abort": "max_tokens"}
# abort: see `Completion.arl_fields` (the real reason travels as `arl_finish_reason`).


async def handle(gen: Generator, session: Session, req: MessagesRequest, model: str) -> Response:
    spec = to_spec(req)
    mid = "msg_" + uuid.uuid4().hex[:24]
    session.completions[mid] = [mid]
    if req.stream:
        items = await gen.stream(session, spec, [mid])
        return StreamingResponse(_stream(mid, model, items), media_type="text/event-stream", headers=SSE_HEADERS)
    (done,) = await gen.complete(session, spec, [mid])
    return json_response(response_body(mid, model, done))


def to_spec(req: MessagesRequest) -> CallSpec:
    messages: list[Message] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else [b.model_dump() for b in req.system]
        messages.append({"role": "system", "content": content_text(system, "system")})
    _check_tool_results(req.messages)
    for i, m in enumerate(req.messages):
        messages.extend(_convert(m, i))
    if req.messages[-1].role == "assistant":
        raise bad_request(
            "the last message is from the assistant: continuing a prefilled assistant turn is not "
            "supported by this proxy; end with a user message",
            param="messages",
        )
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise bad_request(
                f"tools[{i}]: server tool type {t.type!r} is not supported; define client tools "
                "with name, description and input_schema",
                param="tools",
            )
        fn = {"name": t.name, "description": t.description, "parameters": t.input_schema or {"type": "object"}}
        tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    choice, name = "auto", None
    if req.tool_choice is not None:
        choice = {"auto": "auto", "any": "required", "none": "none", "tool": "named"}[req.tool_choice.type]
        name = req.tool_choice.name
        if choice == "named" and not name:
            raise bad_request("tool_choice of type 'tool' needs a name", param="tool_choice")
    return CallSpec(
        messages=messages,
        tools=tools or None,
        tool_choice=choice,
        tool_name=name,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=[s for s in req.stop_sequences or [] if s],
        api="messages",
    )


def _check_tool_results(messages: list[AnthropicMessage]) -> None:
    """As Anthropic's API: every `tool_result` answers a `tool_use` block of the message just before it."""
    offered: set[str] = set()
    for i, m in enumerate(messages):
        blocks = [] if isinstance(m.content, str) else m.content
        extras = [(j, b.type, b.model_extra or {}) for j, b in enumerate(blocks)]
        if m.role == "assistant":
            offered = {str(extra.get("id")) for _, kind, extra in extras if kind == "tool_use"}
            continue
        for j, kind, extra in extras:
            if kind == "tool_result" and str(extra.get("tool_use_id")) not in offered:
                raise bad_request(
                    f"messages[{i}].content[{j}]: tool_result for tool_use_id {extra.get('tool_use_id')!r}, but the "
                    f"message before it has no tool_use block with that id (it has: {sorted(offered) or 'none'})",
                    param="messages",
                )
        offered = set()


def _convert(m: AnthropicMessage, i: int) -> list[Message]:
    where = f"messages[{i}].content"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        return [_assistant(m.content, where)]
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(m.content):
        if block.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            extra = block.model_extra or {}
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(extra.get("tool_use_id") or ""),
                    "content": content_text(extra.get("content"), f"{where}[{j}].content"),
                }
            )
        elif block.type == "text":
            texts.append(block.text or "")
        else:
            raise bad_request(
                f"{where}[{j}]: block type {block.type!r} is not supported in a user message "
                "(text and tool_result are)",
                param="messages",
            )
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[Block], where: str) -> Message:
    message: Message = {"role": "assistant", "content": ""}
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        extra = block.model_extra or {}
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thinking.append(str(extra.get("thinking") or ""))
        elif block.type == "redacted_thinking":
            continue
        elif block.type == "tool_use":
            name = extra.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}[{j}]: a tool_use block needs a name", param="messages")
            tool_input = extra.get("input", {})
            if not isinstance(tool_input, dict):
                raise bad_request(f"{where}[{j}]: tool_use input must be an object", param="messages")
            arguments = json.dumps(tool_input, ensure_ascii=False)
            calls.append(tool_call(str(extra.get("id") or f"toolu_{j}"), name, arguments))
        else:
            raise bad_request(
                f"{where}[{j}]: block type {block.type!r} is not supported in an assistant message", param="messages"
            )
    message["content"] = "\n".join(texts)
    if thinking and any(thinking):
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _blocks(done: Completion) -> list[dict[str, Any]]:
    p = done.parsed
    blocks: list[dict[str, Any]] = []
    if p.reasoning:
        blocks.append({"type": "thinking", "thinking": p.reasoning, "signature": ""})
    if p.content or not p.tool_calls:
        blocks.append({"type": "text", "text": p.content})
    blocks.extend({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)} for c in p.tool_calls)
    return blocks


def _stop(done: Completion) -> tuple[str, str | None]:
    if done.stop_string is not None and done.finish_reason == "stop":
        return "stop_sequence", done.stop_string
    return _STOP[done.finish_reason], None


def response_body(mid: str, model: str, done: Completion) -> dict[str, Any]:
    reason, sequence = _stop(done)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _blocks(done),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens},
        **done.arl_fields(),
    }


async def _stream(mid: str, model: str, items: Any) -> AsyncIterator[bytes]:
    """Anthropic's events: message_start, each content block's start, deltas and stop, message_delta, message_stop."""
    blocks = _Blocks()
    started = False
    try:
        async for item in items:
            if not started:
                started = True
                yield _event("message_start", {"message": _message_start(mid, model)})
            if item.done is not None:
                for chunk in [*blocks.close(), *_message_end(item.done)]:
                    yield chunk
                continue
            for chunk in blocks.feed(item.event):
                yield chunk
    except ApiError as exc:
        yield sse(exc.anthropic_body(), event="error")


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return sse({"type": kind, **data}, event=kind)


def _message_start(mid: str, model: str) -> dict[str, Any]:
    """The message of `message_start`: no content yet, no usage counted yet."""
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


def _message_end(done: Completion) -> list[bytes]:
    """`message_delta` (the stop reason and the usage) and `message_stop`."""
    reason, sequence = _stop(done)
    delta = {
        "delta": {"stop_reason": reason, "stop_sequence": sequence, **done.arl_fields()},
        "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens},
    }
    return [_event("message_delta", delta), _event("message_stop", {})]


_BLOCK_KINDS = {"reasoning": "thinking", "content": "text", "tool_call": "tool_use"}


class _Blocks:
    """The content blocks of a streamed message: a new block starts when the kind of text changes, and every tool
    call is a block of its own (Anthropic streams a block's start, its deltas, then its stop)."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None

    def feed(self, ev: Event) -> list[bytes]:
        """The events of one parser event: the open block's stop and a new block's start if needed, then the delta."""
        kind = _BLOCK_KINDS[ev.kind]
        out = []
        if kind != self.open_kind or kind == "tool_use":
            out += self.close()
            self.index += 1
            self.open_kind = kind
            out.append(_event("content_block_start", {"index": self.index, "content_block": _block_start(kind, ev)}))
        out.append(_event("content_block_delta", {"index": self.index, "delta": _block_delta(kind, ev)}))
        return out

    def close(self) -> list[bytes]:
        """The open block's `content_block_stop` (nothing if none is open)."""
        return [_event("content_block_stop", {"index": self.index})] if self.open_kind is not None else []


def _block_start(kind: str, ev: Event) -> dict[str, Any]:
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if kind == "text":
        return {"type": "text", "text": ""}
    assert ev.call is not None  # a tool_call event carries its call
    return {"type": "tool_use", "id": ev.call.id, "name": ev.call.name, "input": {}}


def _block_delta(kind: str, ev: Event) -> dict[str, Any]:
    if kind == "thinking":
        return {"type": "thinking_delta", "thinking": ev.text}
    if kind == "text":
        return {"type": "text_delta", "text": ev.text}
    assert ev.call is not None
    return {"type": "input_json_delta", "partial_json": ev.call.arguments}
