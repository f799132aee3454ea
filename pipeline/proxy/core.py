"""One LLM call, whatever the API: prompt tokens, engine, parsing, recording.

The three API modules convert their request to a `CallSpec` (normalised messages + tools +
sampling, `pipeline.proxy.prepare`) and their response from `Completion`s / stream events, so the token-exact logic, the
parsers and the recording exist once. Every completion the agent receives is recorded as an
`Interaction` in the session's tree before the response (or the stream's last event) goes out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pipeline.engine.client import EngineClient, EngineError, GenerateResult
from pipeline.engine.tokens import TopEntry
from pipeline.proxy.errors import ApiError
from pipeline.proxy.messages import Message, message_key, tool_call
from pipeline.proxy.parsers import Event, OutputParser, Parsed, collect, parse_text
from pipeline.proxy.prepare import (
    OFFLOAD_CHARS,
    CallSpec,
    Prepared,
    check_context_bound,
    prepare,
    prompt_chars,
    sampling_params,
)
from pipeline.proxy.sessions import Session
from pipeline.proxy.streaming import IncrementalDetokenizer, StopHolder, cut_at_stop
from pipeline.proxy.tokenize import ChatTokenizer
from pipeline.proxy.trajectory import Interaction
from schemas.api.rl import SamplingOverride
from schemas.config.model import ModelConfig
from schemas.config.proxy import ProxyConfig

log = logging.getLogger("arl.proxy.core")


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


@dataclass(frozen=True)
class Sampled:
    """One choice as the engine produced it and the parser read it: what `Generator._record` records."""

    index: int
    """The choice's place among the call's `n`."""
    interaction_id: str
    """The id the recorded interaction gets."""
    output_ids: list[int]
    """The sampled tokens."""
    logprobs: list[float]
    """Their behaviour log-probs, as the engine reported them."""
    versions: list[int]
    """The weight version that sampled each token."""
    engine_reason: str
    """The engine's finish reason (stop | length | abort)."""
    parsed: Parsed
    """The output parsed into content, reasoning and tool calls."""
    stop_string: str | None
    """The stop string the output was cut at, if one matched."""


@dataclass
class StreamItem:
    """A streamed increment of choice `index`: a parser event, or the finished completion."""

    index: int
    event: Event | None = None
    done: Completion | None = None


class Generator:
    """Prepares prompts token-exactly, calls the engine, parses, records (see module docstring)."""

    def __init__(self, tokenizer: ChatTokenizer, engine: EngineClient, model: ModelConfig, proxy: ProxyConfig) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.model = model
        self.proxy = proxy
        self.reasoning_parser = model.reasoning_parser
        head = tokenizer.generation_prompt
        self.prompt_opens_reasoning = head.rfind("<think>") > head.rfind("</think>")
        """The generation prompt ends inside `<think>`: the model's output starts in its reasoning."""
        self._warned_version = False

    def _thinking(self, prep: Prepared) -> bool:
        """Whether this call's output starts inside reasoning (a forced tool call's prefill starts it in content)."""
        return self.prompt_opens_reasoning and not prep.prefill

    # -- prompt ---------------------------------------------------------------------------
    async def prepare_soon(self, session: Session, spec: CallSpec) -> Prepared:
        """`prepare`, without holding up the other sessions: a prompt whose characters alone exceed the context
        is refused before it is rendered; a large one is rendered and tokenized in a worker thread (the
        tokenizer releases the GIL there), so one agent's huge tool output does not freeze the event loop that
        serves every other session. Small prompts, nearly all of them, are prepared inline."""
        chars = prompt_chars(spec)
        check_context_bound(chars, self.tokenizer.max_token_chars, self.model.max_context)
        if chars > OFFLOAD_CHARS:
            return await asyncio.to_thread(self.prepare, session, spec)
        return self.prepare(session, spec)

    def prepare(self, session: Session, spec: CallSpec) -> Prepared:
        """The call's prompt, token-exact against the session's tree (`pipeline.proxy.prepare`)."""
        return prepare(self.tokenizer, self.model, self.proxy, session, spec)

    def sampling_params(
        self, spec: CallSpec, prep: Prepared, index: int, imposed: SamplingOverride | None = None
    ) -> dict[str, Any]:
        """The engine's sampling parameters for choice `index`; `imposed` (the session's) wins over the call's."""
        return sampling_params(spec, prep, index, imposed, self.tokenizer.stop_token_ids)

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
            parsed = parse_text(prep.prefill + text, prep.tool_parser, self.reasoning_parser, self._thinking(prep))
            versions = result.output_versions or [result.weight_version] * len(result.output_ids)
            sampled = Sampled(
                index=i,
                interaction_id=iid,
                output_ids=result.output_ids,
                logprobs=result.output_logprobs,
                versions=versions,
                engine_reason=result.finish_reason,
                parsed=parsed,
                stop_string=stop_string,
            )
            done = self._record(session, spec, prep, sampled)
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
        parser = OutputParser(prep.tool_parser, self.reasoning_parser, self._thinking(prep))
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
        sampled = Sampled(
            index=index,
            interaction_id=iid,
            output_ids=ids,
            logprobs=logprobs,
            versions=versions,
            engine_reason=reason,
            parsed=collect(events),
            stop_string=stopper.stopped,
        )
        done = self._record(session, spec, prep, sampled)
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
    def _record(self, session: Session, spec: CallSpec, prep: Prepared, out: Sampled) -> Completion:
        if out.engine_reason == "abort":
            finish = "abort"
        elif out.engine_reason == "length":
            finish = "length"
        else:
            finish = "tool_calls" if out.parsed.tool_calls else "stop"
        response = assistant_message(out.parsed)
        metadata: dict[str, Any] = {"api": spec.api}
        if out.parsed.tool_calls:  # what the parser accepted: markup in a prompt or a rejected call is not a call
            metadata["parsed_tool_calls"] = len(out.parsed.tool_calls)
        if prep.break_reason:
            metadata["prefix_break_reason"] = prep.break_reason
        if prep.prefill:
            metadata["prefill"] = prep.prefill
        interaction = Interaction(
            id=out.interaction_id,
            session_id=session.id,
            prompt_ids=prep.prompt_ids,
            output_ids=list(out.output_ids),
            output_logprobs=[float(x) for x in out.logprobs],
            output_versions=list(out.versions),
            messages=spec.messages,
            response_message=response,
            parent_id=prep.parent.id if prep.parent is not None else None,
            prefix_break=prep.prefix_break,
            finish_reason=finish,
            created_at=time.time(),
            metadata=metadata,
        )
        session.record(interaction, prep.keys, message_key(response), prep.tools_key, prep.prompt_text)
        return Completion(
            index=out.index,
            interaction=interaction,
            parsed=out.parsed,
            finish_reason=finish,
            stop_string=out.stop_string,
            prompt_tokens=len(prep.prompt_ids),
            completion_tokens=len(out.output_ids),
        )


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
