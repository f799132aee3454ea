"""Response bodies of the capture proxy (docs/proxy.md), as its `/openapi.json` publishes them.

The proxy builds its bodies as plain dicts (speed: `pipeline.proxy.openai_chat`, `openai_responses`,
`anthropic_messages`, `rl`); these models are their contract, checked against real answers by the fuzz
suites (Schemathesis' response-schema conformance) and by the vendors' SDK types in the tests. They name
the fields a client relies on and allow the rest (vendors add fields; so does arl, e.g. `arl_finish_reason`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- errors ------------------------------------------------------------------------------------------
class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """Every error of every route but `/v1/messages` (OpenAI's shape; SDKs raise their usual exception)."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error of `/v1/messages` (Anthropic's shape)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# -- arl's own routes --------------------------------------------------------------------------------
class Health(BaseModel):
    status: Literal["ok"]
    model: str
    open_sessions: int


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    """`GET /v1/models`: the one policy being trained (cards carry OpenAI's and Anthropic's fields)."""

    object: Literal["list"]
    data: list[ModelCard]


class CapacityAnswer(BaseModel):
    available: int
    """Session slots granted and not used yet."""


class RewardAnswer(BaseModel):
    session_id: str
    interaction_ids: list[str]
    reward: float


class EndAnswer(BaseModel):
    session_id: str
    ended: Literal[True]
    num_interactions: int


class ExportAnswer(_Open):
    """`/export_trajectories`: the session's samples (docs/proxy.md; rows: schemas/trajectory.py)."""

    samples: list[dict[str, Any]]
    prefix_breaks: int


# -- OpenAI Chat Completions -------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "tool_calls"]


class Choice(_Open):
    index: int
    message: dict[str, Any]
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason
    arl_finish_reason: Literal["abort"] | None = None
    """arl's: the engine aborted the answer (`finish_reason` is then `length`: it was cut short)."""


class ChatUsage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: ChatUsage


class ChunkChoice(_Open):
    index: int
    delta: dict[str, Any]
    finish_reason: FinishReason | None
    arl_finish_reason: Literal["abort"] | None = None


class ChatCompletionChunk(_Open):
    """One `data:` event of a streamed chat completion (an error mid-stream is an `OpenAIError` event)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None


# -- OpenAI Responses --------------------------------------------------------------------------------
class InputTokensDetails(_Open):
    cached_tokens: int
    cache_write_tokens: int


class ResponseUsage(_Open):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class IncompleteDetails(_Open):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(_Open):
    id: str
    object: Literal["response"]
    created_at: float
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    arl_finish_reason: Literal["abort"] | None = None


class ResponseEvent(_Open):
    """One event of a streamed response (`response.created`, `response.output_text.delta`, ..., `error`)."""

    type: str
    sequence_number: int


# -- Anthropic Messages ------------------------------------------------------------------------------
class MessageUsage(_Open):
    input_tokens: int
    output_tokens: int


class AnthropicMessageObject(_Open):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage
    arl_finish_reason: Literal["abort"] | None = None


class MessageEvent(_Open):
    """One event of a streamed message (`message_start`, `content_block_delta`, ..., `error`)."""

    type: str
