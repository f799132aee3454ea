"""OpenAI Chat Completions request (`POST /v1/chat/completions`), the fields the proxy honours."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from schemas.api.base import INT64_MAX, MAX_STOP_STRINGS, Loose


class ContentPart(Loose):
    type: str
    text: str | None = None


class FunctionCall(Loose):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"
    """A JSON string (the wire format) or, leniently, an object."""


class ToolCall(Loose):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    """Reasoning of an assistant message (as this proxy and vLLM/SGLang return it)."""


class FunctionDef(Loose):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Loose):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Loose):
    name: str = Field(min_length=1)


class NamedToolChoice(Loose):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(Loose):
    include_usage: bool | None = None


class ChatCompletionRequest(Loose):
    model: str | None = None
    """Ignored: the proxy always serves the policy being trained (reported as `model.served_name`)."""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    """Not in OpenAI's API (vLLM/SGLang accept it): top-k sampling, -1 or absent = off."""
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    stop: str | list[str] | None = Field(None)
    n: int | None = Field(default=None, ge=1, le=16)
    seed: int | None = Field(default=None, ge=-INT64_MAX, le=INT64_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s][:MAX_STOP_STRINGS]
