"""`metrics:` — sinks beyond the ones every run has (`metrics/*.jsonl` and TensorBoard under `metrics/tb/`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config.base import Block


class WandbConfig(Block):
    """Weights & Biases: each stage that writes metrics (train, rollout or proxy) logs to its own W&B run,
    all of them in one group per trial, at the same `step` as its JSONL rows (docs/run-directory.md)."""

    project: str = "arl"
    """W&B project the stages' runs go to."""
    entity: str | None = None
    """W&B entity (user or team) owning the project; `None`: the default entity of the API key."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """`online`: stream to the W&B server (the stage's node needs network and `WANDB_API_KEY` or `wandb login`);
    `offline`: write the runs under `metrics/wandb/` only, to upload later with `wandb sync`; `disabled`: W&B
    calls do nothing (wandb is still imported)."""
    group: str | None = None
    """W&B group holding this trial's stage runs; `None`: `<experiment_name>/<trial_name>`."""
    tags: list[str] = Field(default_factory=list)
    """Tags on every stage's W&B run."""


class MetricsConfig(Block):
    wandb: WandbConfig | None = None
    """Log every metrics row to Weights & Biases as well (needs the `wandb` extra: `pip install 'arl[wandb]'`);
    `None`: off, and wandb is never imported. `metrics.wandb.mode=offline` on the command line turns it on."""
