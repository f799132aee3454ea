"""The one writer and the one reader of `state/weight_version.json` (schema: `schemas/weight_version.py`)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from pipeline.errors import SchemaError
from pipeline.handoff import read_json, write_json_atomic
from pipeline.paths import RunPaths
from schemas.weight_version import WeightVersion


def write_weight_version(paths: RunPaths, version: int, checkpoint: Path | None) -> WeightVersion:
    """Announce `version` (the servers verified it) atomically; `checkpoint` is stored run-dir relative."""
    rel = str(checkpoint.relative_to(paths.root)) if checkpoint is not None else None
    now = datetime.now(UTC)
    now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # the file keeps milliseconds
    record = WeightVersion(version=version, checkpoint=rel, published_at=now)
    write_json_atomic(paths.weight_version, record.model_dump(mode="json"))
    return record


def read_weight_version(paths: RunPaths) -> WeightVersion | None:
    """The announced version, or `None` before the first publication (the servers run version 0).

    Raises `SchemaError` naming the file when it does not parse: the trainer writes it atomically,
    so a malformed file is a bug or a hand edit, never a torn write.
    """
    path = paths.weight_version
    try:
        raw = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SchemaError(f"{path} is not JSON: {exc}") from None
    try:
        return WeightVersion.model_validate(raw)
    except ValidationError as exc:
        raise SchemaError(f"{path} is not a weight-version record (docs/run-directory.md): {exc}") from None


def published_version(paths: RunPaths) -> int:
    """The announced version as a number: 0 when nothing has been published yet."""
    record = read_weight_version(paths)
    return record.version if record is not None else 0
