"""The wire side of the engine client: SGLang response shapes in, `GenerateResult` / `GenerateChunk` out.

Kept apart from the routing logic so the parsing rules (cumulative vs incremental streams,
SGLang's string weight versions, error bodies) are unit-tested without a server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pipeline.engine.tokens import TopEntry, expand_spans


@dataclass
class GenerateResult:
    """One finished completion."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    matched: int | str | None  # stop token id or stop string that ended generation
    weight_version: int
    prompt_tokens: int
    completion_tokens: int
    server: str
    output_top_logprobs: list[TopEntry] | None = None
    """Per output token, the (logprob, token id) of the most likely tokens, most likely first;
    None unless the call asked for `top_logprobs_num` > 0."""
    output_versions: list[int] = field(default_factory=list)
    """Per output token, the weight version that sampled it: arl's engines report where it changed inside
    the completion (`meta_info.weight_version_spans`); a server that reports one version per response
    (SGLang) gets `weight_version` on every token."""


@dataclass
class GenerateChunk:
    """One streamed increment: the tokens (and their logprobs) new since the previous chunk."""

    new_ids: list[int]
    new_logprobs: list[float]
    finish_reason: str | None
    matched: int | str | None
    weight_version: int | None
    new_top_logprobs: list[TopEntry] | None = None
    """Top logprobs of `new_ids` (as in `GenerateResult.output_top_logprobs`); None unless asked for."""
    new_versions: list[int] | None = None
    """Per new token, the weight version that sampled it (from `meta_info.weight_version_spans`); None when
    the server reports one version per chunk (SGLang): then `weight_version` is that chunk's."""


class EngineError(Exception):
    """An inference server (or all of them) failed a request.

    `status` is the HTTP status (None for connection errors and timeouts); `server` the URL, or a
    comma-separated list when an admin call failed on several servers.
    """

    def __init__(self, message: str, *, status: int | None = None, server: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.server = server


@dataclass
class StreamState:
    """What a stream has delivered so far, to turn cumulative chunks into increments."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopEntry] = field(default_factory=list)
    top_logprobs_num: int = 0
    """What the request asked for: the stream must then carry one top entry per token."""


def parse_weight_version(value: Any) -> int:
    """SGLang reports `weight_version` as a string ("default" before any update): map it to an int.

    arl always sets it to the decimal version number; "default" (a real SGLang server started
    without `--weight-version`) means the initial weights, version 0.
    """
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(
            f"server reported a non-integer weight_version {value!r}; arl versions are integers "
            "(start SGLang with --weight-version 0)"
        ) from None


def parse_finish_reason(meta: dict[str, Any]) -> tuple[str | None, int | str | None]:
    """(type, matched) from SGLang's `meta_info.finish_reason` (None while a stream is unfinished)."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    if isinstance(reason, str):  # some servers send a bare string
        return reason, None
    kind = str(reason.get("type", "stop"))
    return kind, reason.get("matched")


def _logprob_values(meta: dict[str, Any]) -> list[float]:
    entries = meta.get("output_token_logprobs") or []
    return [float(entry[0]) if entry[0] is not None else float("nan") for entry in entries]


def _top_values(positions: list[Any]) -> list[TopEntry]:
    """SGLang's `output_top_logprobs` (per position `[[logprob, id, text], ...]` or null) as (logprob, id) pairs."""
    return [
        [(float(e[0]) if e[0] is not None else float("nan"), int(e[1])) for e in position or []]
        for position in positions
    ]


def check_top(ids: list[int], top: list[TopEntry], top_logprobs_num: int, url: str) -> None:
    """A server asked for top logprobs must give one entry per output token (else it ignored the field)."""
    if top_logprobs_num > 0 and len(top) != len(ids):
        raise EngineError(
            f"{url} returned {len(ids)} output ids but {len(top)} output_top_logprobs entries for "
            f"top_logprobs_num={top_logprobs_num} (does the server support top_logprobs_num?)",
            server=url,
        )


class Retryable(Exception):
    """A connection-level failure: the request may go to another server."""


def check_single(sampling_params: dict[str, Any]) -> None:
    n = sampling_params.get("n", 1)
    if n != 1:
        raise ValueError(
            f"sampling_params.n={n!r}: EngineClient.generate returns one completion; "
            "issue n concurrent calls with the same sticky_key instead"
        )


def json_or_text(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text


def single_answer(data: Any, url: str) -> dict[str, Any]:
    """A single prompt's `/generate` answer (a server may answer one prompt as a batch of one)."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict):
        raise EngineError(f"{url}/generate answered {type(data).__name__}, expected an object", server=url)
    return data


async def raise_for_status(resp: aiohttp.ClientResponse, url: str) -> None:
    if resp.status < 400:
        return
    text = await resp.text()
    data = json_or_text(text)
    message: Any = data
    if isinstance(data, dict):
        err = data.get("error", data)
        message = (err.get("message") or err.get("error_message") or err) if isinstance(err, dict) else err
    if resp.status == 503:  # paused or starting: another server may serve it
        raise Retryable(f"{url} answered 503: {message}")
    raise EngineError(f"{url} answered {resp.status}: {message}", status=resp.status, server=url)


async def sse_payloads(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE stream (`data: {...}` lines, ending at `data: [DONE]`)."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if isinstance(payload, dict) and "error" in payload and "meta_info" not in payload:
            err = payload["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise EngineError(f"{resp.url} failed mid-stream: {message}", server=str(resp.url))
        yield payload


def result_from(data: dict[str, Any], url: str, top_logprobs_num: int = 0) -> GenerateResult:
    meta = data.get("meta_info") or {}
    ids = [int(t) for t in data.get("output_ids") or []]
    logprobs = _logprob_values(meta)
    reason, matched = parse_finish_reason(meta)
    if len(logprobs) != len(ids):
        raise EngineError(f"{url} returned {len(ids)} output ids but {len(logprobs)} logprobs", server=url)
    top = _top_values(meta.get("output_top_logprobs") or []) if top_logprobs_num > 0 else None
    check_top(ids, top or [], top_logprobs_num, url)
    return GenerateResult(
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=reason or "stop",
        matched=matched,
        weight_version=parse_weight_version(meta.get("weight_version")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", len(ids))),
        server=url,
        output_top_logprobs=top,
        output_versions=token_versions(meta, len(ids), url),
    )


def chunk_from(payload: dict[str, Any], state: StreamState) -> GenerateChunk | None:
    """Turn one SSE payload into an increment.

    SGLang streams *cumulative* `output_ids` / `output_token_logprobs` by default and deltas with
    `--incremental-streaming-output`; `meta_info.completion_tokens` is cumulative in both, which
    tells the two apart.
    """
    meta = payload.get("meta_info") or {}
    ids = [int(t) for t in payload.get("output_ids") or []]
    logprobs = _logprob_values(meta)
    total = int(meta.get("completion_tokens", len(state.ids) + len(ids)))
    if len(ids) == total and len(state.ids) <= total:  # cumulative
        new_ids = ids[len(state.ids) :]
    else:
        new_ids = ids
    new_lps = logprobs[len(state.logprobs) :] if len(logprobs) == total else logprobs
    new_top = None
    if state.top_logprobs_num > 0:
        raw = meta.get("output_top_logprobs") or []
        new_top = _top_values(raw[len(state.top) :] if len(raw) == total else raw)  # convert the new part only
        state.top.extend(new_top)
    state.ids.extend(new_ids)
    state.logprobs.extend(new_lps)
    reason, matched = parse_finish_reason(meta)
    if not new_ids and reason is None:
        return None
    version = meta.get("weight_version")
    new_versions = None
    if "weight_version_spans" in meta:
        versions = token_versions(meta, total, "the stream")
        new_versions = versions[len(state.ids) - len(new_ids) : len(state.ids)]
    return GenerateChunk(
        new_ids=new_ids,
        new_logprobs=new_lps,
        finish_reason=reason,
        matched=matched,
        weight_version=parse_weight_version(version) if version is not None else None,
        new_top_logprobs=new_top,
        new_versions=new_versions,
    )


def token_versions(meta: dict[str, Any], count: int, url: str) -> list[int]:
    """The weight version of each of `count` output tokens: from `weight_version_spans` (arl's engines),
    else the response's one `weight_version` on every token."""
    if "weight_version_spans" not in meta:
        return [parse_weight_version(meta.get("weight_version"))] * count
    try:
        return expand_spans(meta["weight_version_spans"], count)
    except ValueError as exc:
        raise EngineError(f"{url} returned malformed per-token versions: {exc}", server=url) from None
