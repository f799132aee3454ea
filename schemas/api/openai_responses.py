"""OpenAI Responses request (`POST /v1/responses`), the fields the proxy honours.

Input items are kept loose here (`type` + the fields of each kind) and checked when converted, so
an unsupported kind (an image, a built-in tool call) gets a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from schemas.api.base import INT64_MAX, Loose

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputItem(Loose):
    type: str | None = None
    """message (the default when `role` is given), function_call, function_call_output, reasoning."""
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    summary: list[dict[str, Any]] | None = None


class FunctionTool(Loose):
    type: str = "function"
    name: str | None = Field(default=None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(Loose):
    type: Literal["function"]
    name: str = Field(min_length=1)


class ResponsesRequest(Loose):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    """Only `message.output_text.logprobs` has an effect: the output text part then carries `logprobs`."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """Alternatives per token in those logprobs (OpenAI's 0..20)."""

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])
