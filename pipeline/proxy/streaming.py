"""Streaming helpers: incremental detokenization, stop-string hold-back, SSE framing.

Why the hold-backs: a token can end in the middle of a UTF-8 character (byte-level BPE), and a
stop string can arrive split across tokens. Text is only sent once it can no longer change, so
the concatenated deltas equal the non-streamed text exactly (the tests compare the two).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pipeline.proxy.tokenize import ChatTokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for a growing token list (the prefix/read-offset scheme of HF's TextStreamer)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted: list[str] = []

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        window = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if window.endswith(_REPLACEMENT):
            return ""  # a character is still incomplete: wait for its next byte
        done = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        delta = window[len(done) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.emitted.append(delta)
        return delta

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character decodes as U+FFFD, as in the full decode)."""
        full = self.tokenizer.decode(self.ids)
        sent = "".join(self.emitted)
        rest = full[len(sent) :] if full.startswith(sent) else ""
        self.emitted.append(rest)
        return rest


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """`text` up to the earliest stop string in it, and that stop string (None if none occurs)."""
    best, which = len(text), None
    for stop in stops:
        at = text.find(stop)
        if 0 <= at < best:
            best, which = at, stop
    return text[:best], which


class StopHolder:
    """Holds back text that might be the start of a stop string; cuts at a completed one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped: str | None = None

    def push(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        cut, which = cut_at_stop(buf, self.stops)
        if which is not None:
            self.stopped, self.held = which, ""
            return cut
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        rest, self.held = self.held, ""
        return "" if self.stopped is not None else rest


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; `data` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
