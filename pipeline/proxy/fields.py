"""Request fields the proxy cannot honour while keeping its record true: answered with a 400 naming the field,
unless the value is the one that changes nothing or the operator lists the field in `proxy.ignore_fields`.

Why refuse rather than drop: each of these asks for a different sampling distribution or output (penalties and
logit bias reshape the token probabilities, `response_format` constrains decoding to a grammar, the reasoning
controls change what the chat template asks of the model, `parallel_tool_calls: false` forbids a second call).
Dropping one silently would train on samples the agent did not ask for, or hand it output it cannot parse,
while recording log-probabilities as if nothing were asked. A user who wants them dropped says so in the config.

Only fields arl's request models do not declare are looked up here (`model_extra`: a few dict lookups a call),
and `parallel_tool_calls` of the Responses API, which its model declares. docs/proxy.md lists every field of
each API and what arl does with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeline.proxy.errors import bad_request

_DISTRIBUTION = (
    "it changes the distribution tokens are sampled from, and arl records the log-probabilities of "
    "the distribution it samples (it would train on samples the agent did not ask for)"
)
_GRAMMAR = (
    "constrained decoding is not implemented: the reply would not be guaranteed to follow the format, "
    "and its log-probabilities would not be those of a constrained sampler"
)
_TEMPLATE = "reasoning controls reach the model only through its chat template, which arl renders without them"
_ONE_CALL = "arl cannot forbid the model a second tool call (it parses whatever calls the model writes)"


def _zero(value: Any) -> bool:
    return value in (None, 0, 0.0)


def _empty(value: Any) -> bool:
    return value in (None, {}) or value == []


def _text_format(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "text")


def _responses_text(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and _text_format(value.get("format")))


def _parallel_allowed(value: Any) -> bool:
    return value is None or value is True


def _absent(value: Any) -> bool:
    return value is None


def _thinking_off(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "disabled")


Rule = tuple[Callable[[Any], bool], str]
UNHONOURED: dict[str, dict[str, Rule]] = {
    "chat": {
        "presence_penalty": (_zero, _DISTRIBUTION),
        "frequency_penalty": (_zero, _DISTRIBUTION),
        "repetition_penalty": (lambda v: v in (None, 1, 1.0), _DISTRIBUTION),
        "logit_bias": (_empty, _DISTRIBUTION),
        "min_p": (_zero, _DISTRIBUTION),
        "response_format": (_text_format, _GRAMMAR),
        "reasoning_effort": (_absent, _TEMPLATE),
        "parallel_tool_calls": (_parallel_allowed, _ONE_CALL),
    },
    "responses": {
        "text": (_responses_text, _GRAMMAR),
        "reasoning": (_absent, _TEMPLATE),
        "parallel_tool_calls": (_parallel_allowed, _ONE_CALL),
    },
    "messages": {
        "thinking": (_thinking_off, _TEMPLATE),
    },
}
"""Per API: field -> (the values that change nothing, why any other is refused)."""


def refuse_unhonoured(api: str, request: Any, ignore: Sequence[str]) -> None:
    """A 400 naming the first field of `request` that asks for what arl cannot honour (module docstring)."""
    extra = request.model_extra or {}
    for name, (neutral, why) in UNHONOURED[api].items():
        value = extra[name] if name in extra else getattr(request, name, None)
        if value is None or name in ignore or neutral(value):
            continue
        raise bad_request(
            f"{name}={_short(value)} is not supported: {why}. Remove it, or list {name!r} in "
            "proxy.ignore_fields to have the proxy drop it",
            param=name,
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
