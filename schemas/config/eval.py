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

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PydanticCustomError(
                UNSUPPORTED, "eval.sets: the names {names} are used twice; each set needs its own (it names the "
                "set's results and shard directory)", {"names": twice},
            )  # fmt: skip
        return self
