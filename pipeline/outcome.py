"""What an agent run's return value means: the contract shared by the rollout and `pipeline.client`.

A number = the reward of the session's last completion; a dict `{interaction_id: reward}` = rewards
by completion id (`{}` = "I set the rewards myself through `/rl/set_reward`"); `None` = reject the
run (it yields no samples). Anything else is an error (docs/rollout.md, "Agents"). Standard library
only, so the light agent SDK can use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import ArlError


class AgentError(ArlError):
    """The configured agent cannot be loaded or does not follow the agent contract."""


class AgentReturnError(AgentError, TypeError):
    """An agent run returned something other than a number, a dict of rewards or None."""


@dataclass(frozen=True)
class Outcome:
    """An agent's return value, interpreted."""

    rejected: bool
    reward: float | None = None
    """Reward of the last completion (a numeric return)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Rewards by interaction id (a dict return)."""


def interpret_result(value: Any, spec: str = "agent") -> Outcome:
    """float → last completion's reward; dict id → reward; None → rejected; anything else → error."""
    if value is None:
        return Outcome(rejected=True)
    if isinstance(value, bool | int | float) or _is_numpy_scalar(value):
        reward = float(value)
        if not math.isfinite(reward):
            raise AgentReturnError(f"agent {spec!r} returned a non-finite reward {reward!r}")
        return Outcome(rejected=False, reward=reward)
    if isinstance(value, dict):
        rewards: dict[str, float] = {}
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, bool | int | float) or not math.isfinite(float(item)):
                raise AgentReturnError(
                    f"agent {spec!r} returned a dict with entry {key!r}: {item!r}; a reward dict maps interaction "
                    "ids (str, the `id` of each completion) to finite numbers"
                )
            rewards[key] = float(item)
        return Outcome(rejected=False, rewards=rewards)
    raise AgentReturnError(
        f"agent {spec!r} returned {type(value).__name__} {str(value)[:200]!r}; return a number (the last completion's "
        "reward), a dict {interaction_id: reward}, or None to reject the run"
    )


def _is_numpy_scalar(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "item") and isinstance(value.item(), int | float)
