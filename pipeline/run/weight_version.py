"""The one writer and the one reader of `state/weight_version.json` (schema: `schemas/weight_version.py`),
and the staleness rule that says which versions a step may use (docs/rollout.md, "The loop").

The rule lives here, below both its users: the rollout (`pipeline/rollout/staleness.py` and the external
admission in `pipeline/rollout/external.py`) and the trainer (`pipeline/trainer/data.py`) must not import
each other, and they must agree on the bound to the version.
"""

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


def oldest_usable_version(step: int, max_staleness: int) -> int:
    """The staleness rule: step `step` may use weights of version >= max(step - max_staleness, 0).

    Clamped at 0 because version 0 (the initial weights) is the oldest there is: the first
    `max_staleness` steps all accept it, and a wait for a negative version would be meaningless.
    """
    return max(step - max_staleness, 0)


def newest_servable_step(version: int, max_staleness: int) -> int:
    """The same rule read the other way: the newest step that weights of `version` (>= 0) may still serve.

    It is the largest k with `oldest_usable_version(k, max_staleness) <= version`; the clamp at 0 never
    binds there because a published version is never negative (tests/unit/test_rollout_staleness.py
    checks the two against each other).
    """
    return version + max_staleness


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
