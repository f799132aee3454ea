"""Anthropic Messages request (`POST /v1/messages`), the fields the proxy honours.

Content blocks are kept loose (`type` + fields) and checked when converted: text, tool_use,
tool_result, thinking and redacted_thinking are understood; images and documents get a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from schemas.api.base import INT64_MAX, MAX_STOP_STRINGS, Loose


class Block(Loose):
    type: str
    text: str | None = None


class AnthropicMessage(Loose):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Loose):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    """Absent or "custom" for client tools; Anthropic's server tools (bash, web search) are refused."""


class ToolChoice(Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Loose):
    model: str | None = None
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1, le=1_000_000)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
