"""`state/weight_version.json`: the typed record, its one writer and its one reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import SchemaError
from pipeline.run.paths import RunPaths
from pipeline.run.weight_version import published_version, read_weight_version, write_weight_version


def test_round_trip_and_file_shape(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert read_weight_version(paths) is None
    assert published_version(paths) == 0  # nothing published yet: the servers run version 0
    written = write_weight_version(paths, 4, paths.checkpoint_dir(4))
    raw = json.loads(paths.weight_version.read_text())
    assert set(raw) == {"version", "checkpoint", "published_at"}
    assert raw["version"] == 4 and raw["checkpoint"] == "checkpoints/step_000004"
    assert raw["published_at"].endswith("Z") and len(raw["published_at"]) == len("2026-11-22T15:04:05.123Z")
    assert read_weight_version(paths) == written
    assert published_version(paths) == 4


def test_broadcast_only_version_has_no_checkpoint(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    write_weight_version(paths, 2, None)
    record = read_weight_version(paths)
    assert record is not None and record.checkpoint is None and record.version == 2


@pytest.mark.parametrize("content", ["{not json", '{"version": -1}', '{"version": 1, "extra": 2}', "[]"])
def test_malformed_file_names_itself(tmp_path: Path, content: str) -> None:
    paths = RunPaths(tmp_path)
    paths.state.mkdir(parents=True)
    paths.weight_version.write_text(content)
    with pytest.raises(SchemaError, match=r"weight_version\.json"):
        read_weight_version(paths)
