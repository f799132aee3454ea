"""`proxy:` — the OpenAI/Anthropic-compatible capture proxy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config.base import Block


class ProxyConfig(Block):
    host: str = "127.0.0.1"
    """Interface the proxy binds to. It binds nowhere else; use `0.0.0.0` only for external agents."""
    port: int = Field(0, ge=0, le=65535)
    """Port; 0 picks a free one (the chosen URL is written to `registry/proxy/`). With `workers` > 1, worker k
    listens on `port + k` (or on a free port each when 0)."""
    workers: int = Field(1, ge=1, le=64)
    """Proxy processes on the stage's host, each on its own port, to use more than one core. A session lives on
    the worker it was started on (its id names it); capacity and `max_sessions` are counted across all of them.
    The registry entry lists every worker's URL under `urls` (docs/proxy.md, "Several workers")."""
    admin_key: str | None = None
    """Admin key; `None` generates a random one per run, stored in `state/proxy_admin_key` (mode 600)."""
    client_keys: list[str] = Field(default_factory=list)
    """Keys for external agent owners: may start sessions and reward their own sessions, nothing else."""
    session_timeout_s: float = Field(1800.0, gt=0)
    """A session idle this long is ended and cleaned up."""
    max_sessions: int = Field(256, ge=1)
    """Most concurrently open sessions (a start beyond this answers 429)."""
    default_max_tokens: int = Field(512, ge=1)
    """Completion length when a request names none."""
    max_tokens_limit: int = Field(2048, ge=1)
    """Upper bound on any request's completion length (also capped by the context)."""
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest request body accepted (413 beyond)."""
    special_tokens_in_content: Literal["text", "special"] = "text"
    """How special-token strings inside messages (content, reasoning, tool-call arguments) are tokenized: `text`
    (as plain text: a tool's output cannot forge turn boundaries in the recorded tokens) or `special` (as the
    special tokens, as vLLM and SGLang do; only for agents that rely on it). The template's markup is always
    special."""
    history: Literal["template", "sampled"] = "template"
    """What the model is shown of earlier turns when the chat template renders a returned reply otherwise than it
    was sampled (Qwen3 and DeepSeek-R1 drop past reasoning, GLM-4.5 inserts an empty think block, Cohere strips
    content, a tool call's JSON re-spaced): `template` (the template's own rendering, as vLLM or SGLang would
    show it; the call becomes a new sample, counted as a prefix break `template_rewrites_history`) or `sampled`
    (the sampled tokens are kept as history, so the conversation stays one concat row; the model then sees
    history its template would not write)."""
    ignore_fields: list[str] = Field(default_factory=list)
    """Request fields arl cannot honour (penalties, `logit_bias`, `response_format`, reasoning controls,
    `parallel_tool_calls: false`, Anthropic `thinking`) to drop instead of answering 400 (docs/proxy.md)."""
    require_capacity: bool = False
    """If true, `/rl/start_session` needs a prior `/grant_capacity` (staleness control by the rollout)."""
