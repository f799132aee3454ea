"""The normalised message list every API is converted to, and the keys that compare messages.

Normalised form (OpenAI chat shape, what the chat template renders):

    {"role": "system" | "user" | "assistant" | "tool",
     "content": str,                                   # content parts joined, never None
     "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": <JSON str>}}],  # assistant
     "reasoning_content": str,                         # assistant, only when non-empty
     "tool_call_id": str, "name": str}                 # tool

Why keys: an agent sends back the assistant message the proxy returned, but re-serialised by
its SDK (`content: null` vs `""`, arguments JSON with other spacing, extra fields such as
`refusal`, `annotations`, ids regenerated, reasoning dropped). `message_key` keeps only what
decides whether the agent *continued* the conversation: role, text, tool-call names and parsed
arguments. Reasoning is left out: the proxy reuses the generated tokens for history, so a
dropped or edited reasoning field cannot change what the model saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from pipeline.proxy.errors import bad_request

Message = dict[str, Any]
MessageKey = tuple[Any, ...]

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


def content_text(content: Any, where: str) -> str:
    """Join a string / list-of-parts content into one string ("\\n" between parts, as the templates do)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
            else:
                raise bad_request(
                    f"{where}[{i}]: content part of type {kind!r} is not supported: this model reads text only "
                    f"(use parts of type 'text')",
                    param=where,
                )
        return "\n".join(texts)
    raise bad_request(
        f"{where}: content must be a string or a list of text parts, got {type(content).__name__}", param=where
    )


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def canonical_arguments(arguments: Any) -> str:
    """Arguments as sorted, compact JSON when they parse, else the raw string: spacing never matters."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_key(message: Message) -> MessageKey:
    """What two messages must share for one to count as the re-sent other (see module docstring)."""
    role = message["role"]
    content = message.get("content") or ""
    if role == "assistant":
        calls = tuple(
            (c["function"]["name"], canonical_arguments(c["function"]["arguments"]))
            for c in message.get("tool_calls") or ()
        )
        return (role, content, calls)
    return (role, content)


def tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    """Tools change the rendered system/user text, so a request only extends one with the same tools."""
    if not tools:
        return ""
    return json.dumps(list(tools), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prefix_hashes(keys: Iterable[MessageKey]) -> list[int]:
    """h[i] identifies keys[:i]; computed incrementally so matching costs O(messages), not O(messages^2)."""
    hashes = [hash(())]
    for key in keys:
        hashes.append(hash((hashes[-1], key)))
    return hashes


def common_prefix_len(a: Sequence[MessageKey], b: Sequence[MessageKey]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
