"""What an agent run's return value means: the contract shared by the rollout and `pipeline.client`.

A number = the reward of the session's last completion; a dict `{interaction_id: reward}` = rewards
by completion id (`{}` = "I set the rewards myself through `/rl/set_reward`"); `None` = reject the
run (it yields no samples); a pair `(either reward form, {metric: number})` adds per-run metrics the
reward does not show (e.g. an exact-correct flag beside a shaped reward). Anything else is an error
(docs/rollout.md, "Agents"). Standard library only, so the light agent SDK can use it.
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
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-run metrics (the second item of a pair return): averaged per step as `agent/<name>`."""


def interpret_result(value: Any, spec: str = "agent") -> Outcome:
    """float → last completion's reward; dict id → reward; None → rejected; (either, metrics) → with metrics;
    anything else → error."""
    if isinstance(value, tuple):
        if len(value) != 2 or isinstance(value[0], tuple):
            raise AgentReturnError(
                f"agent {spec!r} returned a tuple of {len(value)} items; a pair is "
                "(reward or {interaction_id: reward}, {metric_name: number})"
            )
        outcome = interpret_result(value[0], spec)
        if outcome.rejected:
            raise AgentReturnError(
                f"agent {spec!r} returned (None, metrics): a rejected run has no metrics; return None alone"
            )
        return Outcome(False, outcome.reward, outcome.rewards, _metrics(value[1], spec))
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


METRIC_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _metrics(value: Any, spec: str) -> dict[str, float]:
    """The metrics of a pair return: names usable as metric keys, finite numbers (bools count as 0/1)."""
    if not isinstance(value, dict):
        raise AgentReturnError(
            f"agent {spec!r} returned a pair whose second item is {type(value).__name__}; "
            "it must be a dict {metric_name: number}"
        )
    metrics: dict[str, float] = {}
    for key, item in value.items():
        number = float(item) if isinstance(item, bool | int | float) or _is_numpy_scalar(item) else math.nan
        if not isinstance(key, str) or not key or not set(key) <= METRIC_NAME_CHARS or not math.isfinite(number):
            raise AgentReturnError(
                f"agent {spec!r} returned metric {key!r}: {item!r}; metric names use letters, "
                "digits and _ . - and values are finite numbers"
            )
        metrics[key] = number
    return metrics


def _is_numpy_scalar(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "item") and isinstance(value.item(), int | float)
