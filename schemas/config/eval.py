"""`eval:` — held-out evaluation sets: which agent, which prompts, how many samples, how they are decoded and scored.

`arl eval RUN_DIR` evaluates a checkpoint of a run on these sets (docs/evaluation.md).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from schemas.config.base import UNSUPPORTED, Block


class EvalSetConfig(Block):
    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    """The set's name: in `metrics/eval.jsonl`, in the shard directory `eval/step_<k>/<name>/`, for `--set`."""
    path: str
    """Its prompts: JSONL, Parquet or a saved `datasets` dataset, rows as the agent reads them (as in rollout)."""
    split: str | None = None
    """Split name for a saved `DatasetDict`."""
    limit: int | None = Field(default=None, ge=1)
    """Evaluate only the first `limit` rows."""
    agent: str | None = None
    """The agent (`module:attr` or `file.py:attr`); default: `rollout.agent`, unchanged."""
    agent_kwargs: dict[str, Any] | None = None
    """Its constructor's kwargs; default: `rollout.agent_kwargs` when `agent` is the training agent, else none."""
    num_samples: int = Field(1, ge=1)
    """Runs per prompt (n): pass@k is estimated from them for every k in `pass_at`."""
    pass_at: list[int] = Field(default_factory=list)
    """The k of pass@k (each <= num_samples); default: 1 and num_samples."""
    temperature: float | None = Field(default=None, ge=0)
    """Imposed on every call of an evaluation run, whatever the agent asks; default: 0 (greedy) for one sample per
    prompt, else `rollout.temperature`."""
    top_p: float | None = Field(default=None, gt=0, le=1)
    """Imposed top-p; default: what the agent asks."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Cap on every call's completion length; default: what the agent asks (within `proxy.max_tokens_limit`)."""
    success_metric: str | None = None
    """A run counts as a success (for pass@k) when the agent's metric of this name is true (e.g. `exact_correct`);
    default: when its reward is at least `success_reward`."""
    success_reward: float = 1.0
    """The reward a run needs to count as a success when `success_metric` is not set."""
    max_concurrency: int = Field(32, ge=1)
    """Evaluation runs in flight at once."""
    run_timeout_s: float = Field(300.0, gt=0)
    """Deadline of one run; a run past it counts as a failure (no reward, no success)."""

    @model_validator(mode="after")
    def _pass_at_within_samples(self) -> EvalSetConfig:
        too_big = [k for k in self.pass_at if k < 1 or k > self.num_samples]
        if too_big:
            raise PydanticCustomError(
                UNSUPPORTED,
                "eval set {name}: pass_at {bad} needs k between 1 and num_samples ({n}): pass@k is estimated from "
                "num_samples runs per prompt",
                {"name": self.name, "bad": too_big, "n": self.num_samples},
            )
        return self

    def ks(self) -> list[int]:
        """The k of pass@k to report, sorted."""
        return sorted(set(self.pass_at or [1, self.num_samples]))

    def effective_temperature(self, rollout_temperature: float) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.num_samples == 1 else rollout_temperature


class EvalConfig(Block):
    sets: list[EvalSetConfig] = Field(default_factory=list)
    """The evaluation sets (names unique)."""
    every: int | None = Field(default=None, ge=1)
    """Evaluate during the run every `every` weight versions (every, 2·every, ..., and the last version), in the
    rollout stage beside its steps; default: only offline (`arl eval`)."""
    at_start: bool = False
    """Also evaluate version 0 (the initial model) during the run."""
    hold_timeout_s: float = Field(600.0, gt=0)
    """How long the trainer holds back version v+1 (and its own exit after the last version) while version v's
    evaluation is still running: what keeps an evaluation on the weights it names when it shares the engines
    with rollout. Past it the trainer publishes anyway and that evaluation is not recorded (docs/evaluation.md)."""

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PydanticCustomError(
                UNSUPPORTED,
                "eval.sets: the names {names} are used twice; each set needs its own (it names the "
                "set's results and shard directory)",
                {"names": twice},
            )
        return self

    @model_validator(mode="after")
    def _schedule_needs_sets(self) -> EvalConfig:
        if (self.every is not None or self.at_start) and not self.sets:
            raise PydanticCustomError(
                UNSUPPORTED,
                "eval.every / eval.at_start evaluate during the run, but eval.sets is empty: add a set "
                "(a name and a path) or remove them",
                {},
            )
        return self

    def versions(self, num_steps: int) -> list[int]:
        """The weight versions evaluated during a run of `num_steps` steps (versions 0..num_steps), ascending."""
        due = {0} if self.at_start else set()
        if self.every is not None:
            due.update(range(self.every, num_steps + 1, self.every))
            due.add(num_steps)
        return sorted(due)

    def concurrency(self) -> int:
        """Session slots an in-run evaluation needs at most (its sets run one after another)."""
        return max((s.max_concurrency for s in self.sets), default=0)
