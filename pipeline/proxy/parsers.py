"""Tool calls and reasoning out of generated text, incrementally, with parsers chosen by name.

One design for streaming and non-streaming: a parser is fed text pieces as the engine produces
them and emits events (`reasoning` text, `content` text, a complete `tool_call`); the whole-text
parse is the same parser fed once. So a streamed answer always equals the non-streamed one, and
the tests check that any chunking gives the same events.

Reasoning (`model.reasoning_parser`):
* `think`: an output that starts (after whitespace) with `<think>` holds reasoning up to
  `</think>`; the newlines the templates put inside the markers and after `</think>` are dropped.
  Where the prompt opened the reasoning itself (a generation prompt ending in `<think>\n`: Qwen3.5/3.6,
  DeepSeek-R1, Nemotron 3), the output starts inside it. Tool-call markup inside the reasoning is
  reasoning, never a call: reasoning is split off before tool calls are looked for.
* `none`: everything is content.

Tool calls (`model.tool_parser`), applied to the content only:
* `hermes` (Qwen2.5/Qwen3/Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, any number; text outside them is content (whitespace next to a call is dropped). A block
  whose JSON does not parse stays in the content as text.
* `llama3_json` (Llama 3.1/3.2 JSON tool calling): an output whose content starts with `{` is one
  or more `{"name": ..., "parameters": {...}}` objects separated by `;`; if it does not parse, it
  is content.
* `none`: no tool calls.

Register more with `register_tool_parser(name, cls)` / `register_reasoning_parser(name, cls)`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

EventKind = Literal["reasoning", "content", "tool_call"]


@dataclass
class ToolCall:
    name: str
    arguments: str
    """Arguments as a JSON string (the OpenAI wire format)."""
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class Event:
    kind: EventKind
    text: str = ""
    call: ToolCall | None = None


@dataclass
class Parsed:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with (text to hold back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _arguments_json(value: Any) -> str | None:
    """Arguments as a JSON object string; None when they are not an object."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call_from_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = _arguments_json(obj.get("arguments", obj.get("parameters")))
    return ToolCall(obj["name"], args) if args is not None else None


# ----------------------------------------------------------------------------- tool parsers


class ToolStream:
    """Base: content passes through unchanged, no calls. Subclasses find calls in the content."""

    name = "none"

    def __init__(self) -> None:
        self.calls = 0

    @staticmethod
    def prefill(tool_name: str | None) -> str:
        """Text to put at the start of the assistant turn to begin a call (tool_choice required/named)."""
        return ""

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []


class _WhitespaceHolder:
    """Holds trailing whitespace back so whitespace next to a tool call can be dropped."""

    def __init__(self) -> None:
        self.held = ""

    def text(self, text: str, out: list[Event]) -> None:
        combined = self.held + text
        stripped = combined.rstrip()
        if stripped:
            out.append(Event("content", stripped))
        self.held = combined[len(stripped) :]


class HermesToolStream(ToolStream):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.buf = ""
        self.in_call = False
        self.ws = _WhitespaceHolder()

    @staticmethod
    def prefill(tool_name: str | None) -> str:
        if tool_name is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(tool_name, ensure_ascii=False) + ', "arguments": '

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        while True:
            if self.in_call:
                end = self.buf.find(self.CLOSE)
                if end < 0:
                    return out
                self._close_call(self.buf[:end], out, closed=True)
                self.buf = self.buf[end + len(self.CLOSE) :]
                self.in_call = False
                continue
            start = self.buf.find(self.OPEN)
            if start >= 0:
                self.ws.text(self.buf[:start], out)
                self.ws.held = ""  # whitespace before a call is markup spacing, not content
                self.buf = self.buf[start + len(self.OPEN) :]
                self.in_call = True
                continue
            keep = _partial_suffix(self.buf, self.OPEN)
            self.ws.text(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            return out

    def _close_call(self, body: str, out: list[Event], closed: bool) -> None:
        try:
            call = _call_from_object(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            self.ws.text(self.OPEN + body + (self.CLOSE if closed else ""), out)
            return
        self.calls += 1
        out.append(Event("tool_call", call=call))

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.in_call:  # unterminated: a call if the JSON is complete (EOS right after it)
            self._close_call(self.buf, out, closed=False)
        else:
            self.ws.text(self.buf, out)
        self.buf = ""
        if self.ws.held and not self.calls:
            out.append(Event("content", self.ws.held))
        self.ws.held = ""
        return out


class Llama3JsonToolStream(ToolStream):
    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self.buf = ""
        self.state: Literal["start", "json", "text"] = "start"

    @staticmethod
    def prefill(tool_name: str | None) -> str:
        if tool_name is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(tool_name, ensure_ascii=False) + ', "parameters": '

    def feed(self, text: str) -> list[Event]:
        if self.state == "text":
            return [Event("content", text)] if text else []
        self.buf += text
        if self.state == "start":
            head = self.buf.lstrip()
            if not head:
                return []
            if head[0] != "{":
                self.state = "text"
                out, self.buf = [Event("content", self.buf)], ""
                return out
            self.state = "json"
        return []  # a JSON call is only known to be one when the output ends

    def finish(self) -> list[Event]:
        text, self.buf = self.buf, ""
        if self.state != "json":
            return [Event("content", text)] if text else []
        calls = _split_json_calls(text)
        if calls is None:
            return [Event("content", text)]
        self.calls = len(calls)
        return [Event("tool_call", call=c) for c in calls]


def _split_json_calls(text: str) -> list[ToolCall] | None:
    """`{...}; {...}` -> calls, or None if any piece is not a call object."""
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = _call_from_object(obj)
        if call is None:
            return None
        calls.append(call)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return calls
        if text[pos] != ";":
            return None
        pos += 1


# ----------------------------------------------------------------------------- reasoning


class ReasoningSplitter:
    """Base (`none`): everything is content.

    `opened`: the prompt already opened the reasoning (a generation prompt ending in `<think>\n`, as Qwen3.5,
    DeepSeek-R1 and Nemotron 3 write it), so the output starts inside it."""

    name = "none"

    def __init__(self, opened: bool = False) -> None:
        self.opened = opened

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []


class ThinkSplitter(ReasoningSplitter):
    name = "think"
    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, opened: bool = False) -> None:
        super().__init__(opened)
        self.buf = ""
        self.state: Literal["start", "reasoning", "content"] = "reasoning" if opened else "start"
        self.strip_newlines = opened  # at the start of reasoning or content: drop template newlines

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        if self.state == "start":
            head = self.buf.lstrip()
            if not head or (len(head) < len(self.OPEN) and self.OPEN.startswith(head)):
                return out
            if head.startswith(self.OPEN):
                self.state, self.buf, self.strip_newlines = "reasoning", head[len(self.OPEN) :], True
            else:
                self.state = "content"
        if self.state == "reasoning":
            self._reasoning(out)
        if self.state == "content":
            if self.strip_newlines:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.strip_newlines = False
            if self.buf:
                out.append(Event("content", self.buf))
            self.buf = ""
        return out

    def _reasoning(self, out: list[Event]) -> None:
        if self.strip_newlines:
            self.buf = self.buf.lstrip("\n")
            if not self.buf:
                return
            self.strip_newlines = False
        end = self.buf.find(self.CLOSE)
        if end >= 0:
            piece = self.buf[:end].rstrip("\n")
            if piece:
                out.append(Event("reasoning", piece))
            self.state, self.buf, self.strip_newlines = "content", self.buf[end + len(self.CLOSE) :], True
            return
        safe = len(self.buf) - _partial_suffix(self.buf, self.CLOSE)
        while safe > 0 and self.buf[safe - 1] == "\n":
            safe -= 1  # newlines right before </think> are the template's
        if safe > 0:
            out.append(Event("reasoning", self.buf[:safe]))
            self.buf = self.buf[safe:]

    def finish(self) -> list[Event]:
        text, self.buf = self.buf, ""
        if self.state == "reasoning":
            text = text.rstrip("\n")
            return [Event("reasoning", text)] if text else []
        if self.state == "start":
            return [Event("content", text)] if text else []
        return []


# ----------------------------------------------------------------------------- registry

TOOL_PARSERS: dict[str, type[ToolStream]] = {
    "none": ToolStream,
    "hermes": HermesToolStream,
    "llama3_json": Llama3JsonToolStream,
}
REASONING_PARSERS: dict[str, type[ReasoningSplitter]] = {"none": ReasoningSplitter, "think": ThinkSplitter}


def register_tool_parser(name: str, cls: type[ToolStream]) -> None:
    TOOL_PARSERS[name] = cls


def register_reasoning_parser(name: str, cls: type[ReasoningSplitter]) -> None:
    REASONING_PARSERS[name] = cls


def check_parser_names(tool_parser: str, reasoning_parser: str) -> None:
    """Fail at start-up, not on the first request, for a misspelled parser name."""
    if tool_parser not in TOOL_PARSERS:
        raise ValueError(f"model.tool_parser={tool_parser!r} is not a known parser: {sorted(TOOL_PARSERS)}")
    if reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"model.reasoning_parser={reasoning_parser!r} is not a known parser: {sorted(REASONING_PARSERS)}"
        )


class OutputParser:
    """Reasoning first, then tool calls in what is left: `feed(text)` / `finish()` -> events."""

    def __init__(self, tool_parser: str, reasoning_parser: str, thinking: bool = False) -> None:
        """`thinking`: the prompt opened the reasoning (`ReasoningSplitter`'s `opened`)."""
        self.reasoning = REASONING_PARSERS[reasoning_parser](thinking)
        self.tools = TOOL_PARSERS[tool_parser]()

    def feed(self, text: str) -> list[Event]:
        return self._route(self.reasoning.feed(text))

    def finish(self) -> list[Event]:
        return self._route(self.reasoning.finish()) + self.tools.finish()

    def _route(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if event.kind == "content":
                out.extend(self.tools.feed(event.text))
            else:
                out.append(event)
        return out


def collect(events: list[Event]) -> Parsed:
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [e.call for e in events if e.kind == "tool_call" and e.call is not None]
    return Parsed(reasoning, content, calls)


def parse_text(text: str, tool_parser: str, reasoning_parser: str, thinking: bool = False) -> Parsed:
    """The whole-text parse: the streaming parser fed once."""
    parser = OutputParser(tool_parser, reasoning_parser, thinking)
    return collect(parser.feed(text) + parser.finish())


ParserFactory = Callable[[], OutputParser]
