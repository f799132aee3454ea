"""`state/weight_version.json`: the newest weight version every inference server has confirmed.

Written by the trainer (rank 0) after each publication, atomically, and only once every registered
server answered the update; read by the rollout (its staleness gate), the trainer on resume (to
skip re-publishing), `arl launch --resume` and `arl status`. No file means version 0: the initial
model, which the servers load at start. Read and write it only through
`pipeline.run.weight_version` (`read_weight_version`, `write_weight_version`).

Example:

    {
      "checkpoint": "checkpoints/step_000004",
      "published_at": "2026-11-22T15:04:05.123Z",
      "version": 4
    }
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, field_serializer


class WeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=0)
    """The weight version the servers now sample with (version k = the weights after training step k-1)."""
    checkpoint: str | None = None
    """The checkpoint dir of that version, relative to the run dir; `None` when it was published by
    broadcast only (`trainer.weight_sync: nccl` between two `checkpoint_every` steps)."""
    published_at: datetime | None = None
    """UTC time the last server confirmed the version (ISO-8601 with milliseconds and `Z`)."""

    @field_serializer("published_at")
    def _iso_millis(self, value: datetime | None) -> str | None:
        if value is None:
            return None
        stamp = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
