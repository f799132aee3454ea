"""How a chat template wants a conversation handed to it, found once at start-up by rendering small probes.

Chat templates disagree on two shapes the OpenAI wire format fixes:

* **tool-call arguments.** The wire carries them as a JSON string. Templates written since transformers asked
  for mappings iterate them (`arguments|items`: Qwen3.5, Nemotron 3) or encode them again (`arguments|tojson`:
  Qwen2.5 would write a quoted string, `"{\\"x\\": 1}"`). vLLM and SGLang parse the string into a mapping before
  rendering, for every template; arl does the same, so a template renders what it would render behind them.
  Arguments that are not a JSON object stay the string they were.
* **content.** Text models take a string; templates of vision-language families (Idefics3, SmolVLM, LLaVA-NeXT)
  iterate a list of parts. A template that does not render a string content verbatim is probed with one text part.

A template that renders no text content is refused at start with one line naming what failed
(`UnsupportedTemplate`), instead of failing on an agent's first call. One that renders no tool call in either shape
has no tool support (`renders_tool_calls` False): it serves conversations without tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.errors import ArlError

Message = dict[str, Any]
Render = Callable[[Sequence[Message], Sequence[dict] | None, bool], str]
"""Renders (messages, tools, add_generation_prompt) with the raw template, raising whatever the template raises."""

_MARK = "zq7Probe"
_TURN_MARK = "\x00ARL_TURN\x00"
_TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]


class UnsupportedTemplate(ArlError, ValueError):
    """The chat template cannot render a conversation the proxy must be able to serve (printed in one line)."""


@dataclass(frozen=True)
class MessageStyle:
    """What `adapt` does to every conversation before the template sees it."""

    arguments_mapping: bool = True
    content_parts: bool = False
    renders_tool_calls: bool = True
    """False: neither shape of arguments reaches the rendering (a template without tool support)."""

    def adapt(self, messages: Sequence[Message]) -> list[Message]:
        """The messages in the template's shapes (copies where anything changes; the caller's are not touched)."""
        out = []
        for message in messages:
            changed = message
            calls = message.get("tool_calls")
            if self.arguments_mapping and calls:
                changed = {**changed, "tool_calls": [_mapped(call) for call in calls]}
            content = message.get("content")
            if self.content_parts and isinstance(content, str):
                changed = {**changed, "content": [{"type": "text", "text": content}] if content else []}
            out.append(changed)
        return out


def _mapped(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments = function["arguments"]
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return call
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": value}}


def detect(render: Render, where: str) -> MessageStyle:
    """The style this template renders correctly (module docstring); `where` names the template in errors."""
    content_parts = _content_parts(render, where)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": _MARK})}}
    conversation: list[Message] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    for mapping in (True, False):
        style = MessageStyle(arguments_mapping=mapping, content_parts=content_parts)
        try:
            text = render(style.adapt(conversation), _TOOLS, False)
        except Exception:  # a template's own error, whatever its type: try the other shape
            continue
        if _MARK in text and f'\\"{_MARK}' not in text:
            return style
    # No tool calls in this template (Gemma, Phi-3): conversations without them still render; one with them gets
    # the template's own answer (usually its raise_exception) as a 400.
    return MessageStyle(content_parts=content_parts, renders_tool_calls=False)


def _content_parts(render: Render, where: str) -> bool:
    """Whether content must be a list of text parts: a string content is not rendered verbatim and one part is."""
    conversation: list[Message] = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
    problems = []
    for parts in (False, True):
        try:
            text = render(MessageStyle(content_parts=parts).adapt(conversation), None, False)
        except Exception as exc:  # see detect
            problems.append(f"{'a list of text parts' if parts else 'a string'}: {_first_line(exc)}")
            continue
        if _MARK in text:
            return parts
        problems.append(f"{'a list of text parts' if parts else 'a string'}: the content is not in the rendering")
    raise UnsupportedTemplate(
        f"the chat template of {where} does not render an assistant message's text content ({'; '.join(problems)}); "
        "set model.chat_template to a .jinja file for text conversations"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def text_after_turn(
    render: Render, close: str, messages: Sequence[Message], tools: Sequence[dict] | None, prefix_len: int, full: str
) -> str | None:
    """The template's text for the messages after the returned assistant message (`messages[prefix_len - 1]`)
    and the generation prompt, in a conversation whose earlier text the template rewrites (`full`: its rendering);
    `proxy.history: sampled` keeps the sampled history before it (pipeline/proxy/history.py).

    Found by rendering the conversation with the reply's content marked: the text after the close that follows
    the mark. None where that cannot be told (the template drops the reply's content, has no turn close, or the
    found text is not how `full` ends)."""
    reply = messages[prefix_len - 1]
    if not close or reply.get("role") != "assistant":
        return None
    marked = [*messages[: prefix_len - 1], {**reply, "content": _TURN_MARK}, *messages[prefix_len:]]
    text = render(marked, tools, True)
    at = text.find(_TURN_MARK)
    end = text.find(close, at + len(_TURN_MARK)) if at >= 0 else -1
    if end < 0 or text.count(_TURN_MARK) != 1:
        return None
    new = text[end + len(close) :]
    return new if full.endswith(new) else None
