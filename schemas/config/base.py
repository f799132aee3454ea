"""Shared base for every config block: unknown keys are errors, fields carry docstrings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Block(BaseModel):
    """A config block. `extra="forbid"` turns a typo into an error instead of a silent default."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
