"""The standalone proxy stage's spool (`pipeline.rollout.spool`): exact round trips through real files and
real Parquet, a crash between publishing a step and removing its spool files, and damaged spool files."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.rollout.external import count_session, publish_external_step
from pipeline.rollout.loop import missing_steps
from pipeline.rollout.spool import CONSUMED_KEY, Spool, SpooledSession
from pipeline.rollout.stats import StepTally
from pipeline.run.config import validate_config
from pipeline.run.paths import RunPaths
from pipeline.run.shards import read_manifest, read_step
from pipeline.trainer.synthetic import synthetic_rows
from schemas.trajectory import rows_from_dicts


def _records(seed: int = 0, groups: int = 2, group_size: int = 2) -> list[SpooledSession]:
    """One spooled session per synthetic row, with float32 logprobs that need every bit (tiny, huge, -0)."""
    rng = np.random.default_rng(seed)
    records = []
    rows = rows_from_dicts(synthetic_rows(0, num_groups=groups, group_size=group_size, seed=seed))
    for i, row in enumerate(rows):
        sampled = [m == 1 for m in row.loss_mask]
        values = (-rng.exponential(3.0, len(sampled))).astype(np.float32)
        values[0] = np.float32(-1.1754944e-38)  # subnormal neighbourhood: a lossy float format changes it
        lps = [float(v) if s else 0.0 for v, s in zip(values, sampled, strict=True)]
        sample = dataclasses.replace(row, step=None, session_id=f"sess{seed}x{i:02d}", logprobs=lps)
        records.append(SpooledSession(sample.session_id, "ok", 1000.0 + i, num_interactions=1,
                                      samples=(sample,)))  # fmt: skip
    return records


def _config(tmp_path: Path, **rollout: Any) -> Any:
    rollout = {"source": "external", "batch_size": 4, "max_staleness": 5, **rollout}
    return validate_config({"fileroot": str(tmp_path / "runs"), "num_steps": 3, "model": {"path": "tiny"},
                            "rollout": rollout, "proxy": {"client_keys": ["k"]}})  # fmt: skip


def _bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<f", v) for v in values]


def test_spooled_session_round_trips_exactly_to_the_published_shard(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    spool = Spool(paths)
    records = _records()
    for record in records:
        spool.write(record)
    loaded = spool.load()
    assert loaded == records, "ids, masks, versions and every logprob double read back identical"

    tally = StepTally(0)
    rows = [row for record in loaded for row in count_session(record, 0, tally)]
    publish_external_step(paths, _config(tmp_path), 0, rows, [r.session_id for r in loaded], tally, "external")
    published = {r["session_id"]: r for r in read_step(paths, 0).to_pylist()}
    for record in records:
        (sample,) = record.samples
        row = published[record.session_id]
        assert row["input_ids"] == sample.input_ids and row["versions"] == sample.versions
        assert _bits(row["logprobs"]) == _bits(sample.logprobs), "float32 logprobs bit-exact"


def test_crash_between_publication_and_spool_removal_duplicates_nothing(tmp_path: Path) -> None:
    """The stage published step 0 (manifest written) and died before removing the spool files."""
    paths = RunPaths(tmp_path / "run")
    config = _config(tmp_path)
    spool = Spool(paths)
    first, later = _records(seed=1), _records(seed=2)[:1]
    for record in first + later:
        spool.write(record)
    failed = SpooledSession("failedrun", "failed", 999.0)  # consumed by the step, no samples
    spool.write(failed)
    tally = StepTally(0)
    consumed = [failed.session_id] + [r.session_id for r in first]
    rows = [row for record in [failed, *first] for row in count_session(record, 0, tally)]
    publish_external_step(paths, config, 0, rows, consumed, tally, "external")
    # ... kill -9 here: `spool.remove(consumed)` never ran.
    assert sorted(read_manifest(paths, 0).extra[CONSUMED_KEY]) == sorted(consumed)
    assert tally.agent_errors == 1 and read_manifest(paths, 0).extra["runs"] == 5

    restarted = Spool(paths).load()
    assert [r.session_id for r in restarted] == [later[0].session_id], "only the unpublished session counts"
    assert sorted(p.name for p in paths.proxy_spool.iterdir()) == [f"{later[0].session_id}.json"]
    assert missing_steps(paths, config.num_steps) == [1, 2], "the restarted stage fills step 1 next"
    assert len({r["session_id"] for r in read_step(paths, 0).to_pylist()}) == 4


def test_leftover_tmp_and_damaged_spool_files_are_reported_not_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = RunPaths(tmp_path / "run")
    spool = Spool(paths)
    (good,) = _records(seed=3)[:1]
    spool.write(good)
    leftover = paths.proxy_spool / "abc.json.1a2b3c4d.tmp"  # a write cut short by kill -9
    leftover.write_bytes(good.to_json()[:50])
    damaged = {
        "torn.json": good.to_json()[:-10],
        "wrongformat.json": json.dumps({"format": 99}).encode(),
        "missingfield.json": json.dumps({"format": 1, "session_id": "missingfield"}).encode(),
        "badstatus.json": good.to_json().replace(b'"ok"', b'"weird"').replace(good.session_id.encode(), b"badstatus"),
        "misnamed.json": good.to_json(),
    }
    for name, raw in damaged.items():
        (paths.proxy_spool / name).write_bytes(raw)

    with caplog.at_level(logging.WARNING, logger="arl.proxy.spool"):
        loaded = spool.load()
    assert loaded == [good]
    assert not leftover.exists()
    assert any(str(leftover) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for name, raw in damaged.items():
        kept = paths.proxy_spool / f"{name}.corrupt"
        assert kept.read_bytes() == raw, f"{name} is kept for a person, byte for byte"
        assert any(str(kept) in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR), name
    assert spool.load() == [good], "a second start sees the same spool, no new complaints needed"


def test_a_session_id_that_is_not_a_file_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must match"):
        Spool(RunPaths(tmp_path)).write(SpooledSession("../escape", "ok", 1.0))
