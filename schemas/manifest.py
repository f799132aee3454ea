"""`_MANIFEST.json`: written last into `trajectories/step_%06d/`; its existence means the step is complete.

Example:

    {
      "schema_version": 1,
      "step": 12,
      "created_at": "2026-11-22T15:04:05.123Z",
      "producer": "rollout",
      "tokenizer": "/runs/tiny-model",
      "parts": [
        {"file": "part-rollout-00000.parquet", "rows": 64, "tokens": 40321, "sampled_tokens": 9120,
         "sha256": "9f2c..."}
      ],
      "totals": {"rows": 64, "tokens": 40321, "sampled_tokens": 9120, "sessions": 32, "groups": 8},
      "weight_versions": {"min": 11, "max": 12},
      "extra": {"reward_mean": 0.41}
    }

`parts[].sha256` is of the whole Parquet file; readers verify it before trusting a part.
`weight_versions` is the range of `versions` over sampled tokens (staleness at a glance).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_VERSION = 1


class PartEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str
    """File name inside the step dir (`part-<producer>-<seq>.parquet`)."""
    rows: int = Field(ge=0)
    """Rows (samples) in the part."""
    tokens: int = Field(ge=0)
    """Sum of `len(input_ids)` over the part's rows."""
    sampled_tokens: int = Field(0, ge=0)
    """Sum of `loss_mask` over the part's rows."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex sha256 of the file's bytes."""


class Totals(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    sampled_tokens: int = Field(0, ge=0)
    sessions: int = Field(0, ge=0)
    groups: int = Field(0, ge=0)


class VersionRange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min: int
    max: int


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = MANIFEST_VERSION
    """Trajectory schema version of every part (see `schemas.trajectory.SCHEMA_VERSION`)."""
    step: int = Field(ge=0)
    """The step these trajectories belong to."""
    created_at: str
    """ISO-8601 UTC time the step was published."""
    producer: str
    """Who wrote the step (`rollout`, `proxy-<name>`)."""
    tokenizer: str = ""
    """Tokenizer path the token ids belong to."""
    parts: list[PartEntry]
    """Every Parquet part of the step."""
    totals: Totals
    """Sums over the parts."""
    weight_versions: VersionRange | None = None
    """Min/max weight version over sampled tokens (None for an empty step)."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Producer statistics (reward mean, dropped counts, ...)."""
