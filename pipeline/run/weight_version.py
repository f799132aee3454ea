"""The one writer and the one reader of `state/weight_version.json` (schema: `schemas/weight_version.py`)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from pipeline.errors import SchemaError
from pipeline.run.handoff import read_json, write_json_atomic
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig
from schemas.engine_api import served_adapter
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


def announced_adapter(config: ArlConfig, paths: RunPaths) -> AnnouncedAdapter | None:
    """What an engine client of this run names in its requests: the announced adapter with
    `trainer.lora.publish: adapter`, else nothing (None: the servers' own weights serve)."""
    return AnnouncedAdapter(paths) if config.trainer.publishes_adapters else None


class AnnouncedAdapter:
    """The LoRA adapter of the announced version (`trainer.lora.publish: adapter`): what requests must name.

    Called per request, so the file is re-read at most every `ttl_s`. The publisher keeps the previous
    version's adapter loaded until the next publication, so a name up to `ttl_s` old is still served.
    Version 0 is the base model (a fresh adapter is zero): no adapter is named.
    """

    def __init__(self, paths: RunPaths, ttl_s: float = 0.2) -> None:
        self.paths = paths
        self.ttl_s = ttl_s
        self._name: str | None = None
        self._read_at = -float("inf")

    def __call__(self) -> str | None:
        now = time.monotonic()
        if now - self._read_at >= self.ttl_s:
            self._name = served_adapter(published_version(self.paths))
            self._read_at = now
        return self._name
