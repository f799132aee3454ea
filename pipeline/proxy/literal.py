"""Special-token text inside message content is tokenized as text (`proxy.special_tokens_in_content: text`).

Why: a chat template writes its turn markup as special tokens (`<|im_start|>`, `<|im_end|>`, `<|eot_id|>`),
and a tokenizer matches those strings wherever they occur, so a tool's output or a user message holding
`<|im_end|>\\n<|im_start|>assistant\\n...` would be encoded as real turn boundaries: text from the environment
could forge turns inside the recorded training tokens (and steer the model). vLLM and SGLang encode it that
way; arl does not by default.

How: before rendering, each special token's string inside a message's content, reasoning or tool-call
arguments is replaced by a placeholder of private-use characters (and a private-use marker already in the
content by a placeholder of its own, so the mapping is reversible whatever the content holds). The template's
own markup is untouched. When the rendered text is tokenized, it is cut at the real special tokens as before;
a piece holding placeholders gets its original text back and is encoded by a copy of the tokenizer that reads
special tokens as plain text (`encode_special_tokens`). Everything else is encoded exactly as before, so the
token-exact extension of multi-turn conversations (module docstring of `pipeline.proxy.tokenize`) is unchanged:
rendering and encoding apply the same mapping every time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pipeline.proxy.messages import Message

MARK, END = "\ue000", "\ue001"
"""Private-use characters around a placeholder's code (`x`: the marker itself, a number: a special token)."""


class LiteralSpecials:
    """Escapes special-token strings in messages and encodes escaped pieces with those strings as text."""

    def __init__(self, backend: Any, specials: Sequence[str]) -> None:
        from tokenizers import Tokenizer

        ordered = sorted(specials, key=len, reverse=True)  # longest first, as the tokenizer matches
        self._code = {s: f"{MARK}{i}{END}" for i, s in enumerate(ordered)} | {MARK: f"{MARK}x{END}"}
        self._back = {v: k for k, v in self._code.items()}
        self._find = re.compile("|".join(re.escape(s) for s in [MARK, *ordered]))
        self._placeholder = re.compile(f"{MARK}(?:x|\\d+){END}")
        self.literal = Tokenizer.from_str(backend.to_str())
        self.literal.encode_special_tokens = True  # its own copy: the shared tokenizer keeps matching markup

    def escape(self, text: str) -> str:
        return self._find.sub(lambda m: self._code[m.group()], text) if self._find.search(text) else text

    def escape_messages(self, messages: Sequence[Message]) -> Sequence[Message]:
        """The messages with their text escaped; the same list when no text needs it (the common case)."""
        out = list(messages)
        changed = False
        for i, message in enumerate(messages):
            escaped = self._escape_message(message)
            if escaped is not message:
                out[i], changed = escaped, True
        return out if changed else messages

    def _escape_message(self, message: Message) -> Message:
        copy: Message | None = None
        content = message.get("content")
        if isinstance(content, str) and self._find.search(content):
            copy = {**message, "content": self.escape(content)}
        elif isinstance(content, list) and any(self._needs(p.get("text")) for p in content if isinstance(p, dict)):
            parts = [
                {**p, "text": self.escape(p["text"])} if isinstance(p, dict) and self._needs(p.get("text")) else p
                for p in content
            ]
            copy = {**message, "content": parts}
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str) and self._needs(reasoning):
            copy = {**(copy or message), "reasoning_content": self.escape(reasoning)}
        calls = message.get("tool_calls")
        if calls and any(self._needs(_arguments(c)) for c in calls):
            copy = {
                **(copy or message),
                "tool_calls": [
                    _with_arguments(c, self.escape(_arguments(c))) if self._needs(_arguments(c)) else c for c in calls
                ],
            }
        return copy if copy is not None else message

    def _needs(self, text: Any) -> bool:
        return isinstance(text, str) and self._find.search(text) is not None

    def holds_placeholder(self, piece: str) -> bool:
        return MARK in piece

    def encode(self, piece: str) -> list[int]:
        """Ids of an escaped piece (no real special token in it) with its special-token strings as text."""
        text = self._placeholder.sub(lambda m: self._back[m.group()], piece)
        return list(self.literal.encode_batch([text], add_special_tokens=False)[0].ids)


def _arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    return function.get("arguments") if isinstance(function, dict) else None


def _with_arguments(call: dict[str, Any], arguments: str) -> dict[str, Any]:
    return {**call, "function": {**call["function"], "arguments": arguments}}
