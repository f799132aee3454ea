"""Session control, rewards and export (`/rl/*`, `/grant_capacity`, `/export_trajectories`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from schemas.api.base import Strict


class SamplingOverride(Strict):
    """Sampling the proxy imposes on every LLM call of a session, whatever the agent asks (an evaluation's
    greedy decoding, say, with an agent that always sends its own temperature). Unset fields are left to the call."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    """An upper bound: a call asking for fewer tokens gets fewer."""


class StartSessionRequest(Strict):
    group_id: str | None = Field(default=None, min_length=1, max_length=256)
    """GRPO group of the session's samples; default: the session id (a group of one)."""
    metadata: dict[str, Any] | None = None
    """Stored in every exported row's `metadata` (dataset index, user fields)."""
    sampling: SamplingOverride | None = None
    """Imposed on every call of the session (see `SamplingOverride`)."""


class StartSessionResponse(Strict):
    session_id: str
    api_key: str
    """The session key: give it to the agent as its API key."""
    group_id: str


class GrantCapacityRequest(Strict):
    count: int = Field(default=1, ge=1, le=100_000)
    """Session slots to add (each `/rl/start_session` uses one when `proxy.require_capacity`)."""


class SetRewardRequest(Strict):
    reward: float
    interaction_id: str | None = Field(default=None, min_length=1, max_length=256)
    """An interaction (or completion / response / message) id; default: the session's last completion."""
    session_id: str | None = Field(default=None, min_length=1, max_length=64)
    """Needed with an admin or client key; with a session key it may only name that session."""


class EndSessionRequest(Strict):
    session_id: str | None = Field(default=None, min_length=1, max_length=64)
    """Needed with an admin or client key; with a session key it may only name that session."""


class ExportRequest(Strict):
    session_id: str = Field(min_length=1, max_length=64)
    discount: float = Field(default=1.0, ge=0.0, le=1.0)
    """Reward discount over the conversation tree: node = own + discount x mean(children)."""
    style: Literal["individual", "concat"] = "individual"
    wait_s: float = Field(default=0.0, ge=0.0, le=600.0)
    """How long to wait for the session's calls still in flight before exporting (0: answer 409 at once)."""


class AnyAgentSetReward(Strict):
    completion_id: str = Field(min_length=1, max_length=256)
    reward: float


class AnyAgentFinalize(Strict):
    final_reward: float | None = None
    """Sets the last completion's reward (if given) and ends the session."""
