"""A call's request side: its prompt ids, found token-exactly from the session's tree, and the engine's sampling.

`prepare` looks for the interaction the call extends (`Session.find_parent`). When it finds one whose
messages the call repeats exactly, the prompt is that interaction's prompt + sampled tokens + the tokens of
the new messages only (`ChatTokenizer.extend`, docs/proxy.md "Token-exact multi-turn"); otherwise the
conversation is rendered and tokenized whole, and the reason (`break_reason`) goes into the recording. The
API modules build the `CallSpec`; `pipeline.proxy.core.Generator` runs the engine on the `Prepared` prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.proxy.errors import ApiError, bad_request
from pipeline.proxy.history import sampled_history_kept
from pipeline.proxy.messages import Message, MessageKey, message_key, tools_key
from pipeline.proxy.parsers import TOOL_PARSERS
from pipeline.proxy.sessions import Session
from pipeline.proxy.tokenize import ChatTokenizer
from pipeline.proxy.trajectory import Interaction
from schemas.api.rl import SamplingOverride
from schemas.config.model import ModelConfig
from schemas.config.proxy import ProxyConfig


@dataclass
class CallSpec:
    """An API-independent chat call."""

    messages: list[Message]
    tools: list[dict] | None = None
    """OpenAI chat function tools: [{"type": "function", "function": {"name", "description", "parameters"}}]."""
    tool_choice: str = "auto"
    """auto | none | required | named."""
    tool_name: str | None = None
    """The tool of a named tool_choice."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    api: str = "chat"
    top_logprobs: int = 0
    """Most likely alternatives to report per sampled token (the engine's `top_logprobs_num`); 0 = none."""


@dataclass
class Prepared:
    """A call's prompt, ready for the engine, and what its recording needs to know about how it was built."""

    prompt_ids: list[int]
    """The prompt's token ids: the parent's prompt + sampled tokens + the new suffix, or a fresh render's."""
    parent: Interaction | None
    """The interaction this call extends, if the session holds one."""
    prefix_break: bool
    """A parent was found but its tokens could not be reused (the prompt was rendered whole)."""
    break_reason: str | None
    """Why (`history_edited`, `template_not_prefix_stable`, `template_rewrites_history`); None without a break."""
    keys: list[MessageKey]
    """The call's messages as the session's tree compares them."""
    tools_key: str
    """The rendered tools, as the session's tree compares them."""
    render_tools: list[dict] | None
    """The tools rendered into the prompt (only the named one for a named tool_choice)."""
    prefill: str
    """Text the assistant turn starts with (a forced tool call's opening), already in `prompt_ids`."""
    tool_parser: str
    """The parser of the answer's tool calls (`none` when no tool may be called)."""
    max_new_tokens: int
    """The engine's budget: the call's max_tokens, capped by the session's, the proxy's and the context."""
    prompt_text: str | None = None
    """The rendered conversation (without prefill), cached on the node for the next turn's fast path."""


OFFLOAD_CHARS = 65536
"""Prompts with more characters of content than this are prepared in a worker thread (`Generator.prepare_soon`)."""


def prompt_chars(spec: CallSpec) -> int:
    """Characters of the call's message contents and tool calls (a lower bound of the rendered prompt's)."""
    total = 0
    for message in spec.messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                total += len(function["arguments"])
    return total


def prepare(
    tokenizer: ChatTokenizer, model: ModelConfig, proxy: ProxyConfig, session: Session, spec: CallSpec
) -> Prepared:
    """The call's prompt (module docstring) and its token budget."""
    if not spec.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    render_tools, prefill, tool_parser = _tools(spec, model.tool_parser)
    keys = [message_key(m) for m in spec.messages]
    tkey = tools_key(render_tools)
    match = session.find_parent(keys, tkey)
    parent, prompt_ids, reason, text = match.parent, None, None, None
    if parent is not None and match.exact:
        cached = session.prompt_text(parent.id)
        if cached is not None and spec.messages[: match.prefix_len - 1] != parent.messages:
            cached = None  # the fast path needs the very messages the cached text was rendered from
        keep_sampled = proxy.history == "sampled"
        ext = tokenizer.extend(
            spec.messages, render_tools, match.prefix_len, parent.output_ids, prefill, cached, keep_sampled
        )
        if ext is None:
            reason = "template_not_prefix_stable"
        elif not keep_sampled and not sampled_history_kept(tokenizer, session, parent, ext):
            reason = "template_rewrites_history"
        else:
            prompt_ids = [*parent.prompt_ids, *parent.output_ids, *ext.suffix_ids]
            text = ext.full_text
    elif parent is not None:
        reason = "history_edited"
    if prompt_ids is None:
        text = tokenizer.render(spec.messages, render_tools, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text + prefill)
    room = check_context(len(prompt_ids), model.max_context)
    wanted = spec.max_tokens if spec.max_tokens is not None else proxy.default_max_tokens
    imposed = session.sampling.max_tokens if session.sampling is not None else None
    max_new = max(1, min(wanted, imposed or wanted, proxy.max_tokens_limit, room))
    return Prepared(
        prompt_ids=prompt_ids,
        parent=parent,
        prefix_break=reason is not None,
        break_reason=reason,
        keys=keys,
        tools_key=tkey,
        render_tools=render_tools,
        prefill=prefill,
        tool_parser=tool_parser,
        max_new_tokens=max_new,
        prompt_text=text,
    )


def _tools(spec: CallSpec, parser: str) -> tuple[list[dict] | None, str, str]:
    """(tools to render, assistant prefill, tool parser name) for the tool_choice; `parser`: the model's."""
    tools = spec.tools or None
    if tools is None or spec.tool_choice == "none":
        if spec.tool_choice in ("required", "named"):
            raise bad_request(f"tool_choice={spec.tool_choice!r} needs tools", param="tool_choice")
        return None, "", "none"
    cls = TOOL_PARSERS[parser]
    if spec.tool_choice == "named":
        chosen = [t for t in tools if t["function"]["name"] == spec.tool_name]
        if not chosen:
            names = [t["function"]["name"] for t in tools]
            raise bad_request(
                f"tool_choice names {spec.tool_name!r}, which is not among the tools {names}", param="tool_choice"
            )
        return chosen, cls.prefill(spec.tool_name), parser
    if spec.tool_choice == "required":
        return tools, cls.prefill(None), parser
    return tools, "", parser


def sampling_params(
    spec: CallSpec, prep: Prepared, index: int, imposed: SamplingOverride | None, stop_token_ids: frozenset[int]
) -> dict[str, Any]:
    """The engine's sampling parameters for choice `index`; `imposed` (the session's) wins over the call's."""
    params: dict[str, Any] = {"max_new_tokens": prep.max_new_tokens, "stop_token_ids": sorted(stop_token_ids)}
    temperature, top_p = spec.temperature, spec.top_p
    if imposed is not None:  # no model built per call: this runs for every choice of every call
        temperature, top_p = _first(imposed.temperature, temperature), _first(imposed.top_p, top_p)
    if temperature is not None:
        params["temperature"] = temperature
    if top_p is not None:
        params["top_p"] = top_p
    if spec.top_k is not None and spec.top_k > 0:
        params["top_k"] = spec.top_k
    if spec.stop:
        params["stop"] = list(spec.stop)
    if spec.seed is not None:
        params["sampling_seed"] = spec.seed + index
    return params


def _first(imposed: float | None, asked: float | None) -> float | None:
    return imposed if imposed is not None else asked


def check_context_bound(chars: int, max_token_chars: int, max_context: int) -> None:
    """Refuse, before any rendering or tokenizing, a prompt whose characters alone prove it too long."""
    at_least = -(-chars // max(max_token_chars, 1))
    if at_least >= max_context:
        raise ApiError(
            400,
            f"the prompt holds {chars} characters, so at least {at_least} tokens (no token of this tokenizer is "
            f"longer than {max_token_chars} characters), but the model's context is {max_context} tokens "
            "(model.max_context): shorten the conversation",
            param="messages",
            code="context_length_exceeded",
        )


def check_context(prompt_len: int, max_context: int) -> int:
    """Tokens left for the completion; a 400 naming both numbers when the prompt does not fit."""
    room = max_context - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"the prompt is {prompt_len} tokens but the model's context is {max_context} tokens "
            f"(model.max_context): shorten the conversation",
            param="messages",
            code="context_length_exceeded",
        )
    return room
