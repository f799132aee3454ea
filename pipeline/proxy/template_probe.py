"""Start-up probes of a chat template: may the proxy render less than the whole conversation?

Both fast paths of `ChatTokenizer.extend` rest on a property of the template, checked here on
varied conversations (system or not, tools or not, tool chains, both parities of message count):

* turn-local: an assistant turn renders the same whatever precedes it, so render(history +
  assistant) = render(history, generation prompt) - generation prompt + the assistant turn.
* suffix-local: the messages after an assistant message render the same whatever precedes that
  assistant message, so the new text of a request is the rendering of a short *window*
  (`WINDOW` + the assistant message + the new messages) minus the window's own prefix.

A template that fails a probe takes the next slower path, which is exact for any template (see
tokenize.py). Templates that rewrite earlier turns depending on later ones (e.g. dropping old
reasoning), number messages, or check role alternation fail them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pipeline.proxy.errors import ApiError

WINDOW: list[dict[str, Any]] = [{"role": "user", "content": "u"}]
"""What stands for the history when only the end of a conversation is rendered."""

_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
REPLIES: list[dict[str, Any]] = [
    {"role": "assistant", "content": "a"},
    {"role": "assistant", "content": "", "tool_calls": [_CALL]},
    {"role": "assistant", "content": "b", "reasoning_content": "r", "tool_calls": [_CALL, _CALL]},
]
CONTEXTS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "q"}], None),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], _TOOLS),
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "t", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "c", "content": "1"},
            {"role": "tool", "tool_call_id": "c", "content": "2"},
        ],
        _TOOLS,
    ),
    (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}],
        None,
    ),
    ([{"role": "system", "content": "s"}], None),
]
SUFFIXES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "n"}],
    [{"role": "tool", "tool_call_id": "c", "content": "r"}],
    [
        {"role": "tool", "tool_call_id": "c", "content": "r1"},
        {"role": "tool", "tool_call_id": "c", "content": "r2"},
        {"role": "user", "content": "n"},
    ],
    [{"role": "system", "content": "s2"}, {"role": "user", "content": "n"}],
    [{"role": "user", "content": "n"}, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "n2"}],
]


class Template(Protocol):
    """What the probes ask of a chat template (`pipeline.proxy.tokenize.ChatTokenizer` provides it; the
    probes name this Protocol rather than that class so that the two modules do not import each other)."""

    generation_prompt: str

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None, add_generation_prompt: bool
    ) -> str: ...

    def assistant_turn(self, assistant: dict[str, Any]) -> str | None: ...

    def render_after(self, assistant: dict[str, Any], new: Sequence[dict[str, Any]]) -> str | None: ...


def generation_prompt(tok: Template) -> str:
    """The text `add_generation_prompt` appends (Qwen: `<|im_start|>assistant\\n`); "" if none is found."""
    try:
        with_prompt = tok.render(WINDOW, None, add_generation_prompt=True)
        without = tok.render(WINDOW, None, add_generation_prompt=False)
    except ApiError:
        return ""
    return with_prompt[len(without) :] if with_prompt.startswith(without) else ""


def turn_local(tok: Template) -> bool:
    """See the module docstring."""
    head = tok.generation_prompt
    if not head:
        return False
    try:
        for context, tools in CONTEXTS:
            gen = tok.render(context, tools, add_generation_prompt=True)
            for reply in REPLIES:
                turn = tok.assistant_turn(reply)
                full = tok.render([*context, reply], tools, add_generation_prompt=False)
                if turn is None or not gen.endswith(head) or full != gen[: len(gen) - len(head)] + turn:
                    return False
    except ApiError:
        return False
    return True


def suffix_local(tok: Template) -> bool:
    """See the module docstring (only asked of a turn-local template)."""
    try:
        for context, tools in CONTEXTS:
            for reply in REPLIES:
                base = tok.render([*context, reply], tools, add_generation_prompt=False)
                for new in SUFFIXES:
                    full = tok.render([*context, reply, *new], tools, add_generation_prompt=True)
                    after = tok.render_after(reply, new)
                    if after is None or full != base + after:
                        return False
    except ApiError:
        return False
    return True
