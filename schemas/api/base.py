"""Shared bases of the API models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Loose(BaseModel):
    """A vendor request object: unknown fields are kept (and ignored), NaN/inf are refused.

    Types are strict, as the published JSON Schema says: `"stream": 0` or `"temperature": false` is a 400
    naming the field, not a coerced value (an integer is still a valid number: `"temperature": 1`).
    """

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="null", allow_inf_nan=False, strict=True)


class Strict(BaseModel):
    """An arl control body: unknown fields are errors (a typo must not be silently ignored); types are strict
    (`{"count": true}` is refused, not read as 1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# Bounds that keep every number the engine receives representable (seeds are 64-bit there).
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 16
