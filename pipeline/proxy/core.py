"""One LLM call, whatever the API: prompt tokens, engine, parsing, recording.

The three API modules convert their request to a `CallSpec` (normalised messages + tools +
sampling) and their response from `Completion`s / stream events, so the token-exact logic, the
parsers and the recording exist once. Every completion the agent receives is recorded as an
`Interaction` in the session's tree before the response (or the stream's last event) goes out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pipeline.engine.client import EngineClient, EngineError, GenerateResult
from pipeline.engine.tokens import TopEntry
from pipeline.proxy.errors import ApiError, bad_request
from pipeline.proxy.messages import Message, MessageKey, message_key, tool_call, tools_key
from pipeline.proxy.parsers import TOOL_PARSERS, Event, OutputParser, Parsed, collect, parse_text
from pipeline.proxy.sessions import Session
from pipeline.proxy.streaming import IncrementalDetokenizer, StopHolder, cut_at_stop
from pipeline.proxy.tokenize import ChatTokenizer, check_context, check_context_bound
from pipeline.proxy.trajectory import Interaction
from schemas.api.rl import SamplingOverride
from schemas.config.model import ModelConfig
from schemas.config.proxy import ProxyConfig

log = logging.getLogger("arl.proxy.core")


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
    prompt_ids: list[int]
    parent: Interaction | None
    prefix_break: bool
    break_reason: str | None
    keys: list[MessageKey]
    tools_key: str
    render_tools: list[dict] | None
    prefill: str
    tool_parser: str
    max_new_tokens: int
    prompt_text: str | None = None
    """The rendered conversation (without prefill), cached on the node for the next turn's fast path."""


@dataclass
class Completion:
    """One finished choice, recorded."""

    index: int
    interaction: Interaction
    parsed: Parsed
    finish_reason: str  # stop | length | tool_calls | abort
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    top_logprobs: list[TopEntry] | None = None
    """Per output token, the (logprob, token id) alternatives the engine reported; only for the response
    (the recorded interaction keeps the sampled tokens' logprobs alone)."""

    @property
    def id(self) -> str:
        return self.interaction.id

    def arl_fields(self) -> dict[str, str]:
        """`{"arl_finish_reason": "abort"}` for an engine abort, else nothing.

        No API has an "abort" value: an aborted answer (a pause in abort mode, a weight update that aborts
        requests) was cut short, so each API reports it with its own truncation value (chat `length`,
        Responses `incomplete`/`max_output_tokens`, Anthropic `max_tokens`: the client may continue it) and
        this field keeps the real reason for clients that care (docs/proxy.md, "Finish reasons")."""
        return {"arl_finish_reason": "abort"} if self.finish_reason == "abort" else {}

    @property
    def truncated(self) -> bool:
        return self.finish_reason in ("length", "abort")


@dataclass
class StreamItem:
    """A streamed increment of choice `index`: a parser event, or the finished completion."""

    index: int
    event: Event | None = None
    done: Completion | None = None


_OFFLOAD_CHARS = 65536
"""Prompts with more characters of content than this are prepared in a worker thread (`prepare_soon`)."""


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


def _first(imposed: float | None, asked: float | None) -> float | None:
    return imposed if imposed is not None else asked


class Generator:
    """Prepares prompts token-exactly, calls the engine, parses, records (see module docstring)."""

    def __init__(self, tokenizer: ChatTokenizer, engine: EngineClient, model: ModelConfig, proxy: ProxyConfig) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.model = model
        self.proxy = proxy
        self.reasoning_parser = model.reasoning_parser
        self._warned_version = False

    # -- prompt ---------------------------------------------------------------------------
    async def prepare_soon(self, session: Session, spec: CallSpec) -> Prepared:
        """`prepare`, without holding up the other sessions: a prompt whose characters alone exceed the context
        is refused before it is rendered; a large one is rendered and tokenized in a worker thread (the
        tokenizer releases the GIL there), so one agent's huge tool output does not freeze the event loop that
        serves every other session. Small prompts, nearly all of them, are prepared inline."""
        chars = prompt_chars(spec)
        check_context_bound(chars, self.tokenizer.max_token_chars, self.model.max_context)
        if chars > _OFFLOAD_CHARS:
            return await asyncio.to_thread(self.prepare, session, spec)
        return self.prepare(session, spec)

    def prepare(self, session: Session, spec: CallSpec) -> Prepared:
        if not spec.messages:
            raise bad_request("messages must hold at least one message", param="messages")
        render_tools, prefill, tool_parser = self._tools(spec)
        keys = [message_key(m) for m in spec.messages]
        tkey = tools_key(render_tools)
        match = session.find_parent(keys, tkey)
        parent, prompt_ids, reason, text = match.parent, None, None, None
        if parent is not None and match.exact:
            cached = session.prompt_text(parent.id)
            if cached is not None and spec.messages[: match.prefix_len - 1] != parent.messages:
                cached = None  # the fast path needs the very messages the cached text was rendered from
            ext = self.tokenizer.extend(
                spec.messages, render_tools, match.prefix_len, parent.output_ids, prefill, parent_text=cached
            )
            if ext is not None:
                prompt_ids = [*parent.prompt_ids, *parent.output_ids, *ext.suffix_ids]
                text = ext.full_text
            else:
                reason = "template_not_prefix_stable"
        elif parent is not None:
            reason = "history_edited"
        if prompt_ids is None:
            text = self.tokenizer.render(spec.messages, render_tools, add_generation_prompt=True)
            prompt_ids = self.tokenizer.encode(text + prefill)
        room = check_context(len(prompt_ids), self.model.max_context)
        wanted = spec.max_tokens if spec.max_tokens is not None else self.proxy.default_max_tokens
        imposed = session.sampling.max_tokens if session.sampling is not None else None
        max_new = max(1, min(wanted, imposed or wanted, self.proxy.max_tokens_limit, room))
        return Prepared(
            prompt_ids,
            parent,
            reason is not None,
            reason,
            keys,
            tkey,
            render_tools,
            prefill,
            tool_parser,
            max_new,
            text,
        )

    def _tools(self, spec: CallSpec) -> tuple[list[dict] | None, str, str]:
        """(tools to render, assistant prefill, tool parser name) for the tool_choice."""
        tools = spec.tools or None
        parser = self.model.tool_parser
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
        self, spec: CallSpec, prep: Prepared, index: int, imposed: SamplingOverride | None = None
    ) -> dict[str, Any]:
        """The engine's sampling parameters for choice `index`; `imposed` (the session's) wins over the call's."""
        params: dict[str, Any] = {
            "max_new_tokens": prep.max_new_tokens,
            "stop_token_ids": sorted(self.tokenizer.stop_token_ids),
        }
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

    # -- non-streaming ----------------------------------------------------------------------
    async def complete(self, session: Session, spec: CallSpec, ids: list[str]) -> list[Completion]:
        """Generate `len(ids)` choices concurrently and record each as an interaction."""
        prep = await self.prepare_soon(session, spec)
        session.inflight += 1
        try:
            results = await asyncio.gather(
                *(
                    self._generate(
                        prep.prompt_ids,
                        self.sampling_params(spec, prep, i, session.sampling),
                        session.id,
                        spec.top_logprobs,
                    )
                    for i in range(len(ids))
                )
            )
        finally:
            session.inflight -= 1
            session.touch()
        completions = []
        for i, (iid, result) in enumerate(zip(ids, results, strict=True)):
            text, stop_string = self._output_text(result.output_ids, spec.stop)
            parsed = parse_text(prep.prefill + text, prep.tool_parser, self.reasoning_parser)
            versions = result.output_versions or [result.weight_version] * len(result.output_ids)
            done = self._record(
                session,
                spec,
                prep,
                i,
                iid,
                result.output_ids,
                result.output_logprobs,
                versions,
                result.finish_reason,
                parsed,
                stop_string,
            )
            done.top_logprobs = result.output_top_logprobs
            completions.append(done)
        return completions

    async def _generate(self, prompt_ids: list[int], params: dict[str, Any], sticky: str, top: int) -> GenerateResult:
        try:
            return await self.engine.generate(prompt_ids, params, sticky_key=sticky, top_logprobs_num=top)
        except EngineError as exc:
            raise _engine_api_error(exc) from None

    def _output_text(self, output_ids: list[int], stops: list[str]) -> tuple[str, str | None]:
        text = self.tokenizer.decode(output_ids)
        return cut_at_stop(text, stops) if stops else (text, None)

    # -- streaming --------------------------------------------------------------------------
    async def stream(self, session: Session, spec: CallSpec, ids: list[str]) -> AsyncIterator[StreamItem]:
        """Stream parser events of every choice as tokens arrive; each choice ends with its `done` item.

        `prepare` runs before the first item, so request errors are raised before any byte is sent.
        """
        prep = await self.prepare_soon(session, spec)
        return self._stream_all(session, spec, prep, ids)

    async def _stream_all(
        self, session: Session, spec: CallSpec, prep: Prepared, ids: list[str]
    ) -> AsyncIterator[StreamItem]:
        session.inflight += 1
        try:
            if len(ids) == 1:
                async for item in self._stream_one(session, spec, prep, 0, ids[0]):
                    yield item
                return
            queue: asyncio.Queue[StreamItem | BaseException | None] = asyncio.Queue()

            async def pump(index: int, iid: str) -> None:
                try:
                    async for item in self._stream_one(session, spec, prep, index, iid):
                        await queue.put(item)
                except Exception as exc:
                    await queue.put(exc)
                finally:
                    await queue.put(None)

            tasks = [asyncio.create_task(pump(i, iid)) for i, iid in enumerate(ids)]
            try:
                remaining = len(tasks)
                while remaining:
                    got = await queue.get()
                    if got is None:
                        remaining -= 1
                    elif isinstance(got, BaseException):
                        raise got
                    else:
                        yield got
            finally:
                for task in tasks:
                    task.cancel()
        finally:
            session.inflight -= 1
            session.touch()

    async def _stream_one(
        self, session: Session, spec: CallSpec, prep: Prepared, index: int, iid: str
    ) -> AsyncIterator[StreamItem]:
        detok = IncrementalDetokenizer(self.tokenizer)
        stopper = StopHolder(spec.stop)
        parser = OutputParser(prep.tool_parser, self.reasoning_parser)
        events: list[Event] = list(parser.feed(prep.prefill))
        for event in events:
            yield StreamItem(index, event)
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[TopEntry] = []
        versions: list[int] = []
        reason, version = "stop", None
        try:
            params = self.sampling_params(spec, prep, index, session.sampling)
            async for chunk in self.engine.generate_stream(
                prep.prompt_ids, params, sticky_key=session.id, top_logprobs_num=spec.top_logprobs
            ):
                version = chunk.weight_version if chunk.weight_version is not None else version
                ids.extend(chunk.new_ids)
                logprobs.extend(chunk.new_logprobs)
                top.extend(chunk.new_top_logprobs or [])
                versions.extend(chunk.new_versions or [self._version(version)] * len(chunk.new_ids))
                for event in parser.feed(stopper.push(detok.push(chunk.new_ids))):
                    events.append(event)
                    yield StreamItem(index, event)
                if chunk.finish_reason is not None:
                    reason = chunk.finish_reason
        except EngineError as exc:
            raise _engine_api_error(exc) from None
        tail = parser.feed(stopper.push(detok.flush()) + stopper.finish()) + parser.finish()
        for event in tail:
            events.append(event)
            yield StreamItem(index, event)
        done = self._record(
            session, spec, prep, index, iid, ids, logprobs, versions, reason, collect(events), stopper.stopped
        )
        done.top_logprobs = top if spec.top_logprobs > 0 else None
        yield StreamItem(index, done=done)

    def _version(self, version: int | None) -> int:
        if version is None:
            if not self._warned_version:
                log.warning("the engine reported no weight_version while streaming; recording version 0")
                self._warned_version = True
            return 0
        return version

    # -- recording --------------------------------------------------------------------------
    def _record(
        self,
        session: Session,
        spec: CallSpec,
        prep: Prepared,
        index: int,
        iid: str,
        output_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        engine_reason: str,
        parsed: Parsed,
        stop_string: str | None,
    ) -> Completion:
        if engine_reason == "abort":
            finish = "abort"
        elif engine_reason == "length":
            finish = "length"
        else:
            finish = "tool_calls" if parsed.tool_calls else "stop"
        response = assistant_message(parsed)
        metadata: dict[str, Any] = {"api": spec.api}
        if prep.break_reason:
            metadata["prefix_break_reason"] = prep.break_reason
        if prep.prefill:
            metadata["prefill"] = prep.prefill
        interaction = Interaction(
            id=iid,
            session_id=session.id,
            prompt_ids=prep.prompt_ids,
            output_ids=list(output_ids),
            output_logprobs=[float(x) for x in logprobs],
            output_versions=list(versions),
            messages=spec.messages,
            response_message=response,
            parent_id=prep.parent.id if prep.parent is not None else None,
            prefix_break=prep.prefix_break,
            finish_reason=finish,
            created_at=time.time(),
            metadata=metadata,
        )
        session.record(interaction, prep.keys, message_key(response), prep.tools_key, prep.prompt_text)
        return Completion(index, interaction, parsed, finish, stop_string, len(prep.prompt_ids), len(output_ids))


def assistant_message(parsed: Parsed) -> Message:
    """The normalised assistant message for a parse (what is stored and compared next turn)."""
    message: Message = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call(c.id, c.name, c.arguments) for c in parsed.tool_calls]
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    return message


def _engine_api_error(exc: EngineError) -> ApiError:
    """Engine 4xx are the request's fault (400 with the engine's words); the rest is 502/503."""
    if exc.status is not None and 400 <= exc.status < 500:
        return ApiError(400, f"the inference server refused the request: {exc}")
    if exc.status is None:
        return ApiError(503, f"no inference server could serve the request: {exc}")
    return ApiError(502, f"the inference server failed: {exc}")


def token_logprobs(tokenizer: ChatTokenizer, completion: Completion) -> list[dict[str, Any]]:
    """OpenAI's logprob entries (`token`, `logprob`, `bytes`, `top_logprobs`) per sampled token, the
    trailing end-of-turn token left out; `top_logprobs` lists the engine's alternatives, most likely
    first (empty when the call asked for none)."""
    ids = completion.interaction.output_ids
    lps = completion.interaction.output_logprobs
    tops = completion.top_logprobs or [[] for _ in ids]
    if ids and ids[-1] in tokenizer.stop_token_ids:
        ids, lps = ids[:-1], lps[:-1]
    texts: dict[int, str] = {}  # the same alternatives recur from position to position: decode each once

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    return [
        {**entry(tid, lp), "top_logprobs": [entry(t, v) for v, t in top]}
        for tid, lp, top in zip(ids, lps, tops, strict=False)
    ]
