"""Shared base for every config block: unknown keys are errors, fields carry docstrings."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


class Block(BaseModel):
    """A config block. `extra="forbid"` turns a typo into an error instead of a silent default."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    renamed_keys: ClassVar[dict[str, str]] = {}
    """Keys this block no longer has -> how to write them now, so an old config is told the new key
    instead of only "unknown key" (`pipeline.run.config` reports it for files and overrides alike)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, hint in cls.renamed_keys.items():
                if old in data:
                    raise PydanticCustomError(RENAMED_KEY, "{old} was replaced: {hint}", {"old": old, "hint": hint})
        return data


RENAMED_KEY = "renamed_key"
"""The pydantic error type of a renamed key (its context holds `old` and `hint`)."""
UNSUPPORTED = "unsupported_combination"
"""The pydantic error type of settings that cannot work together (its message names them and the fix)."""
