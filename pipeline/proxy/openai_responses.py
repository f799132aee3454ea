"""OpenAI Responses API: input items -> normalised messages, output items and stream events back.

Items understood: `message` (user/system/developer/assistant, string or text parts), `reasoning`,
`function_call`, `function_call_output`. A run of assistant-side items (reasoning, an assistant
message, function calls) becomes one assistant message, which is how a returned response round-trips.
`instructions` become a leading system message (not carried over by `previous_response_id`, as
OpenAI documents). `previous_response_id` names a response of the same session: its conversation
and output are prepended to the new input. With `include: ["message.output_text.logprobs"]` the
message's output text part carries `logprobs` (every sampled token, as chat's `logprobs.content`)
with `top_logprobs` alternatives each; in a stream they come in `response.output_text.done`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response, StreamingResponse

from pipeline.proxy.core import Completion, Generator, token_logprobs
from pipeline.proxy.errors import ApiError, bad_request
from pipeline.proxy.http import json_response
from pipeline.proxy.messages import Message, content_text, tool_call
from pipeline.proxy.parsers import Event
from pipeline.proxy.prepare import CallSpec
from pipeline.proxy.sessions import Session
from pipeline.proxy.streaming import SSE_HEADERS, sse
from schemas.api.openai_responses import InputItem, ResponsesRequest


async def handle(gen: Generator, session: Session, req: ResponsesRequest, model: str) -> Response:
    chain = _chain(session, req)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + chain
    spec = _spec(req, messages)
    rid = "resp_" + uuid.uuid4().hex[:24]
    session.completions[rid] = [rid]
    if req.stream:
        items = await gen.stream(session, spec, [rid])
        body = _stream(rid, model, req, items, session, chain, gen)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    (done,) = await gen.complete(session, spec, [rid])
    builder = _Output()
    for event in _events_of(done):
        builder.add(event)
    _attach_logprobs(builder, gen, req, done)
    output = builder.close_all()
    _remember(session, rid, chain, done)
    return json_response(_response(rid, model, req, output, done))


def _chain(session: Session, req: ResponsesRequest) -> list[Message]:
    """The conversation (without instructions): the previous response's chain + its output + the input."""
    prefix: list[Message] = []
    if req.previous_response_id:
        stored = session.responses.get(req.previous_response_id)
        if stored is None:
            raise ApiError(
                404, f"no response {req.previous_response_id!r} in this session", param="previous_response_id"
            )
        prefix = [*stored["chain"], stored["output"]]
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    return prefix + items_to_messages(items)


def items_to_messages(items: list[InputItem]) -> list[Message]:
    out: list[Message] = []
    pending: Message | None = None  # the assistant message being assembled

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            out.append(pending)
            pending = None

    for i, item in enumerate(items):
        kind = item.type or ("message" if item.role else None)
        where = f"input[{i}]"
        if kind == "message" and item.role != "assistant":
            flush()
            if item.role is None:
                raise bad_request(f"{where}: a message item needs a role", param="input")
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": content_text(item.content, f"{where}.content")})
        elif kind in ("message", "reasoning", "function_call"):
            if pending is None or (pending.get("tool_calls") and kind != "function_call"):
                flush()
                pending = {"role": "assistant", "content": ""}
            _merge_assistant(pending, item, kind, where)
        elif kind == "function_call_output":
            flush()
            output = item.output if item.output is not None else ""
            out.append(
                {"role": "tool", "tool_call_id": item.call_id or "", "content": content_text(output, f"{where}.output")}
            )
        else:
            raise bad_request(
                f"{where}: input items of type {kind!r} are not supported (use message, reasoning, "
                "function_call, function_call_output)",
                param="input",
            )
    flush()
    return out


def _merge_assistant(pending: Message, item: InputItem, kind: str, where: str) -> None:
    if kind == "message":
        text = content_text(item.content, f"{where}.content")
        pending["content"] = pending["content"] + ("\n" if pending["content"] and text else "") + text
    elif kind == "reasoning":
        parts = list(item.model_extra.get("content") or []) if item.model_extra else []
        texts = [p.get("text", "") for p in parts if isinstance(p, dict)]
        if not texts:
            texts = [p.get("text", "") for p in item.summary or [] if isinstance(p, dict)]
        text = "\n".join(t for t in texts if isinstance(t, str))
        if text:
            pending["reasoning_content"] = text
    else:
        if not item.name:
            raise bad_request(f"{where}: a function_call item needs a name", param="input")
        calls = pending.setdefault("tool_calls", [])
        calls.append(tool_call(item.call_id or f"call_{len(calls)}", item.name, item.arguments or "{}"))


def _spec(req: ResponsesRequest, messages: list[Message]) -> CallSpec:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function" or not t.name:
            raise bad_request(
                f"tools[{i}]: only function tools with a name are supported, got type {t.type!r}", param="tools"
            )
        fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
        tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    choice, name = "auto", None
    if isinstance(req.tool_choice, str):
        choice = req.tool_choice
    elif req.tool_choice is not None:
        choice, name = "named", req.tool_choice.name
    top = (req.top_logprobs or 0) if req.wants_logprobs() else 0  # no alternatives are computed unless shown
    return CallSpec(
        messages=messages,
        tools=tools or None,
        tool_choice=choice,
        tool_name=name,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        api="responses",
        top_logprobs=top,
    )


def _events_of(done: Completion) -> list[Event]:
    p = done.parsed
    events = [Event("reasoning", p.reasoning)] if p.reasoning else []
    if p.content or not p.tool_calls:
        events.append(Event("content", p.content))
    events.extend(Event("tool_call", call=c) for c in p.tool_calls)
    return events


def _attach_logprobs(builder: _Output, gen: Generator, req: ResponsesRequest, done: Completion) -> None:
    """Put the completion's token logprobs on the first message's output text part (when included)."""
    if not req.wants_logprobs():
        return
    for item in builder.items:
        if item["type"] == "message":
            item["content"][0]["logprobs"] = token_logprobs(gen.tokenizer, done)
            return


def _remember(session: Session, rid: str, chain: list[Message], done: Completion) -> None:
    session.responses[rid] = {"chain": chain, "output": done.interaction.response_message}


class _Output:
    """Output items built from parser events, with the stream events that announce them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None

    def add(self, event: Event) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if event.kind == "tool_call" and event.call is not None:
            out += self.close()
            c = event.call
            item: dict[str, Any] = {
                "type": "function_call",
                "id": "fc_" + uuid.uuid4().hex[:24],
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "completed",
            }
            index = len(self.items)
            self.items.append(item)
            base = {"item_id": item["id"], "output_index": index}
            out += [
                (
                    "response.output_item.added",
                    {"output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}},
                ),
                ("response.function_call_arguments.delta", {**base, "delta": c.arguments}),
                ("response.function_call_arguments.done", {**base, "arguments": c.arguments, "name": c.name}),
                ("response.output_item.done", {"output_index": index, "item": item}),
            ]
            return out
        kind = "reasoning" if event.kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            out += self._open(kind)
        current = self.open
        assert current is not None
        part = current["content"][0]
        part["text"] += event.text
        base = {"item_id": current["id"], "output_index": len(self.items) - 1, "content_index": 0, "delta": event.text}
        if kind == "reasoning":
            out.append(("response.reasoning_text.delta", base))
        else:
            out.append(("response.output_text.delta", {**base, "logprobs": []}))
        return out

    def _open(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        item: dict[str, Any]
        if kind == "reasoning":
            item = {
                "type": "reasoning",
                "id": "rs_" + uuid.uuid4().hex[:24],
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
        else:
            item = {
                "type": "message",
                "id": "msg_" + uuid.uuid4().hex[:24],
                "role": "assistant",
                "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
            }
        self.open = item
        index = len(self.items)
        self.items.append(item)
        empty = {**item, "content": []} if kind == "message" else item
        events = [("response.output_item.added", {"output_index": index, "item": _copy(empty)})]
        if kind == "message":
            events.append(
                (
                    "response.content_part.added",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "part": dict(item["content"][0]),
                    },
                )
            )
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.items.index(item)
        part = item["content"][0]
        base = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            events = [("response.reasoning_text.done", {**base, "text": part["text"]})]
        else:
            events = [
                ("response.output_text.done", {**base, "text": part["text"], "logprobs": part["logprobs"]}),
                ("response.content_part.done", {**base, "part": dict(part)}),
            ]
        events.append(("response.output_item.done", {"output_index": index, "item": _copy(item)}))
        return events

    def close_all(self) -> list[dict[str, Any]]:
        self.close()
        return self.items


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)


def _response(
    rid: str, model: str, req: ResponsesRequest, output: list[dict[str, Any]], done: Completion | None
) -> dict[str, Any]:
    status = "in_progress" if done is None else ("incomplete" if done.truncated else "completed")
    usage = None
    if done is not None:
        usage = {
            "input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},  # the SDK requires both
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        }
    tools = [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            "strict": t.strict,
        }
        for t in req.tools or []
    ]
    choice = (
        req.tool_choice.model_dump()
        if req.tool_choice is not None and not isinstance(req.tool_choice, str)
        else (req.tool_choice or "auto")
    )
    return {
        "id": rid,
        "object": "response",
        "created_at": time.time(),
        "status": status,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": choice,
        "tools": tools,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "usage": usage,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "top_logprobs": req.top_logprobs,
        **(done.arl_fields() if done is not None else {}),
    }


async def _stream(
    rid: str, model: str, req: ResponsesRequest, items: Any, session: Session, chain: list[Message], gen: Generator
) -> AsyncIterator[bytes]:
    seq = 0

    def event(kind: str, data: dict[str, Any]) -> bytes:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **data}, event=kind)

    yield event("response.created", {"response": _response(rid, model, req, [], None)})
    yield event("response.in_progress", {"response": _response(rid, model, req, [], None)})
    builder = _Output()
    try:
        async for item in items:
            if item.done is not None:
                _attach_logprobs(builder, gen, req, item.done)
                for kind, data in builder.close():
                    yield event(kind, data)
                _remember(session, rid, chain, item.done)
                final = "response.incomplete" if item.done.truncated else "response.completed"  # as OpenAI
                yield event(final, {"response": _response(rid, model, req, builder.items, item.done)})
            elif item.event is not None:
                for kind, data in builder.add(item.event):
                    yield event(kind, data)
    except ApiError as exc:
        yield event("error", {"code": exc.code, "message": exc.message, "param": exc.param})
