"""Shard I/O: real Parquet on disk, read back by arl and by pandas/DuckDB/polars/datasets without arl."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.errors import SchemaError
from pipeline.run.paths import MANIFEST, RunPaths
from pipeline.run.shards import (
    StepNotFound,
    list_complete_steps,
    read_manifest,
    read_part,
    read_step,
    step_stats,
    write_step,
)
from schemas.trajectory import SCHEMA, TrajectoryRow, rows_from_dicts, validate_row

REPO = Path(__file__).resolve().parents[2]


def make_rows(n: int, step: int = 0, *, prompt: int = 6, sampled: int = 4, seed: int = 0) -> list[TrajectoryRow]:
    """`n` valid rows: `prompt` unsampled tokens then `sampled` ones of version max(step-1, 0)."""
    return rows_from_dicts(make_dicts(n, step, prompt=prompt, sampled=sampled, seed=seed))


def make_dicts(n: int, step: int = 0, *, prompt: int = 6, sampled: int = 4, seed: int = 0) -> list[dict]:
    """`make_rows` as plain dicts of every column (`created_at` a UTC datetime), to edit before converting."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = prompt + sampled
        mask = [0] * prompt + [1] * sampled
        rows.append(
            {
                "step": step,
                "session_id": f"sess-{i // 2}",
                "sample_id": f"sample-{seed}-{i}",
                "parent_id": None if i % 3 else f"p-{i}",
                "group_id": f"group-{i // 4}",
                "input_ids": [rng.randrange(0, 500) for _ in range(length)],
                "loss_mask": mask,
                "logprobs": [0.0] * prompt + [-rng.random() for _ in range(sampled)],
                "versions": [-1] * prompt + [max(step - 1, 0)] * sampled,
                "reward": float(i % 2),
                "prompt_len": prompt,
                "num_turns": 1,
                "finish_reason": "stop" if i % 5 else "length",
                "created_at": datetime(2026, 11, 22, 12, 0, i % 60, tzinfo=UTC),
                "metadata": json.dumps({"index": i, "prefix_break": i == 1}),
            }
        )
    return rows


@pytest.fixture
def paths(tmp_path: Path) -> RunPaths:
    return RunPaths(tmp_path / "run")


def test_round_trip_with_manifest(paths: RunPaths) -> None:
    rows = make_dicts(10, step=3)
    manifest = write_step(paths, 3, rows_from_dicts(rows), producer="rollout", tokenizer="/models/tiny",
                          rows_per_part=4)  # fmt: skip
    assert [p.file for p in manifest.parts] == [
        "part-rollout-00000.parquet", "part-rollout-00001.parquet", "part-rollout-00002.parquet"
    ]  # fmt: skip
    assert [p.rows for p in manifest.parts] == [4, 4, 2]
    assert manifest.totals.rows == 10 and manifest.totals.tokens == 100 and manifest.totals.sampled_tokens == 40
    assert manifest.totals.sessions == 5 and manifest.totals.groups == 3
    assert manifest.weight_versions is not None and manifest.weight_versions.min == 2
    assert read_manifest(paths, 3) == manifest
    assert list_complete_steps(paths) == [3]
    table = read_step(paths, 3)
    assert table.num_rows == 10
    assert table.schema.metadata[b"arl.tokenizer"] == b"/models/tiny"
    back = table.to_pylist()
    for original, got in zip(rows, back, strict=True):
        validate_row(got)
        assert got["input_ids"] == original["input_ids"]
        assert got["logprobs"] == pytest.approx(original["logprobs"], abs=1e-7)
        assert got["created_at"] == original["created_at"]
    subset = read_step(paths, 3, columns=["input_ids", "loss_mask"])
    assert subset.column_names == ["input_ids", "loss_mask"] and subset.num_rows == 10


def test_epoch_ms_created_at_is_accepted(paths: RunPaths) -> None:
    rows = make_dicts(2)
    rows[0]["created_at"] = 1_790_000_000_123
    write_step(paths, 0, rows_from_dicts(rows), producer="proxy-a", tokenizer="t")
    got = read_step(paths, 0, columns=["created_at"]).column(0).to_pylist()[0]
    assert int(got.timestamp() * 1000) == 1_790_000_000_123


def test_parts_readable_by_pandas_and_duckdb_without_arl(paths: RunPaths) -> None:
    pd = pytest.importorskip("pandas")
    duckdb = pytest.importorskip("duckdb")
    write_step(paths, 1, make_rows(9, step=1), producer="rollout", tokenizer="t", rows_per_part=5)
    step_dir = paths.step_dir(1)
    frame = pd.read_parquet(step_dir)  # pyarrow's dataset reader skips `_MANIFEST.json`
    assert len(frame) == 9 and list(frame.columns) == SCHEMA.names
    assert frame["loss_mask"].map(sum).sum() == 36
    con = duckdb.connect()
    count, tokens, reward = con.execute(
        f"SELECT count(*), sum(len(input_ids)), avg(reward) FROM read_parquet('{step_dir}/*.parquet')"
    ).fetchone()
    assert (count, tokens, reward) == (9, 90, pytest.approx(4 / 9))


def test_doc_snippets_polars_and_datasets(paths: RunPaths, tmp_path: Path) -> None:
    """The reading recipes of docs/trajectory-schema.md, with no arl code."""
    pl = pytest.importorskip("polars")
    datasets = pytest.importorskip("datasets")
    write_step(paths, 2, make_rows(6, step=2), producer="rollout", tokenizer="t", rows_per_part=4)
    pattern = str(paths.step_dir(2) / "part-*.parquet")
    frame = pl.read_parquet(pattern)
    assert frame.height == 6 and frame["prompt_len"].to_list() == [6] * 6
    manifest = json.loads((paths.step_dir(2) / MANIFEST).read_text())
    files = [str(paths.step_dir(2) / p["file"]) for p in manifest["parts"]]
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == 6 and ds[0]["loss_mask"] == [0] * 6 + [1] * 4


def test_rewrite_replaces_the_step_whole(paths: RunPaths) -> None:
    write_step(paths, 0, make_rows(12), producer="rollout", tokenizer="t", rows_per_part=3)
    assert len(list(paths.step_dir(0).glob("part-*.parquet"))) == 4
    write_step(paths, 0, make_rows(2, seed=1), producer="proxy-x", tokenizer="t")
    files = sorted(p.name for p in paths.step_dir(0).iterdir())
    assert files == [MANIFEST, "part-proxy-x-00000.parquet"]
    assert read_step(paths, 0).column("sample_id").to_pylist() == ["sample-1-0", "sample-1-1"]
    assert not [p for p in paths.trajectories.iterdir() if p.name.endswith(".tmp")]


def test_corrupt_part_is_named_in_the_error(paths: RunPaths) -> None:
    write_step(paths, 0, make_rows(4), producer="rollout", tokenizer="t", rows_per_part=2)
    victim = paths.step_dir(0) / "part-rollout-00001.parquet"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(SchemaError, match=r"part-rollout-00001\.parquet: sha256 .* does not match"):
        read_step(paths, 0)
    # Without checksum verification the damage is still reported per file, never as a raw Arrow error.
    victim.write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(SchemaError, match=r"part-rollout-00001\.parquet: not a readable Parquet file"):
        read_step(paths, 0, verify=False)


def test_other_schema_version_is_refused(paths: RunPaths, tmp_path: Path) -> None:
    write_step(paths, 0, make_rows(2), producer="rollout", tokenizer="t")
    part = paths.step_dir(0) / "part-rollout-00000.parquet"
    table = pq.read_table(part)
    future = tmp_path / "future.parquet"
    pq.write_table(table.replace_schema_metadata({b"arl.schema_version": b"2", b"arl.tokenizer": b"t"}), future)
    with pytest.raises(SchemaError, match="schema version 2, this arl reads version 1"):
        read_part(future)
    bare = tmp_path / "bare.parquet"
    pq.write_table(table.replace_schema_metadata(None), bare)
    with pytest.raises(SchemaError, match="not an arl shard"):
        read_part(bare)
    manifest = paths.step_manifest(0)
    manifest.write_text(manifest.read_text().replace('"schema_version": 1', '"schema_version": 7'))
    with pytest.raises(SchemaError, match="version 7"):
        read_step(paths, 0)


def test_missing_step_and_unknown_columns(paths: RunPaths) -> None:
    with pytest.raises(StepNotFound, match=r"no _MANIFEST\.json"):
        read_step(paths, 5)
    write_step(paths, 5, make_rows(1, step=5), producer="rollout", tokenizer="t")
    with pytest.raises(SchemaError, match=r"unknown columns \['tokens'\]"):
        read_step(paths, 5, columns=["tokens"])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("loss_mask", [0] * 6 + [1, 1, 1, 2], "other than 0/1"),
        ("loss_mask", [0] * 10, "no sampled token"),
        ("prompt_len", 5, "prompt_len=5"),
        ("versions", [0] * 6 + [1] * 4, "not sampled"),
        ("logprobs", [0.0] * 6 + [0.5] * 4, "sampled token"),
        ("input_ids", [1] * 9, "differ in length"),
        ("finish_reason", "eos", "finish_reason"),
        ("num_turns", 0, "num_turns"),
        ("metadata", "[1]", "JSON object"),
        ("metadata", "{", "not JSON"),
        ("input_ids", [-1] * 10, "negative token id"),
    ],
)
def test_invalid_rows_are_refused_like_validate_row(paths: RunPaths, field: str, value: object, message: str) -> None:
    rows = make_dicts(3)
    rows[1][field] = value
    with pytest.raises(SchemaError):
        validate_row(rows[1])
    with pytest.raises(SchemaError):
        validate_row(rows_from_dicts(rows)[1])
    with pytest.raises(SchemaError, match=message) as info:
        write_step(paths, 0, rows_from_dicts(rows), producer="rollout", tokenizer="t")
    assert "row 1 (sample 'sample-0-1')" in str(info.value)
    assert list_complete_steps(paths) == []


def test_wrong_step_missing_column_and_naive_time_are_refused(paths: RunPaths) -> None:
    with pytest.raises(SchemaError, match="must have step=4"):
        write_step(paths, 4, make_rows(2, step=3), producer="rollout", tokenizer="t")
    rows = make_dicts(2)
    del rows[1]["reward"]
    with pytest.raises(SchemaError, match=r"row 1 .* no column 'reward'"):
        write_step(paths, 0, rows_from_dicts(rows), producer="rollout", tokenizer="t")
    rows = make_dicts(2)
    rows[0]["created_at"] = datetime(2026, 1, 1)
    with pytest.raises(SchemaError, match="no time zone"):
        write_step(paths, 0, rows_from_dicts(rows), producer="rollout", tokenizer="t")
    unassigned = [row.at_step(0) for row in make_rows(2)]
    unassigned[1] = dataclasses.replace(unassigned[1], step=None)
    with pytest.raises(SchemaError, match="must have step=0"):
        write_step(paths, 0, unassigned, producer="rollout", tokenizer="t")
    with pytest.raises(ValueError, match="producer"):
        write_step(paths, 0, make_rows(1), producer="a/b", tokenizer="t")


def test_empty_step(paths: RunPaths) -> None:
    manifest = write_step(paths, 0, [], producer="rollout", tokenizer="t")
    assert manifest.parts == [] and manifest.weight_versions is None
    assert read_step(paths, 0).num_rows == 0
    assert step_stats(read_step(paths, 0), 0)["count"] == 0


def test_step_stats(paths: RunPaths) -> None:
    write_step(paths, 3, make_rows(8, step=3), producer="rollout", tokenizer="t")
    stats = step_stats(read_step(paths, 3))
    assert stats["step"] == 3 and stats["count"] == 8 and stats["sessions"] == 4 and stats["groups"] == 2
    assert stats["reward_mean"] == pytest.approx(0.5) and stats["reward_std"] == pytest.approx(0.5)
    assert stats["length_p50"] == 10 and stats["length_max"] == 10
    assert stats["min_version"] == 2 and stats["staleness_max"] == 1
    assert stats["prefix_breaks"] == 1 and stats["finish_reasons"] == {"length": 2, "stop": 6}


def test_stats_over_multi_turn_rows_with_mixed_versions(paths: RunPaths) -> None:
    rows = make_rows(2, step=6)
    rows[0] = dataclasses.replace(rows[0], input_ids=[1, 2, 3, 4, 5, 6], loss_mask=[0, 1, 1, 0, 1, 1], prompt_len=1,
                                  num_turns=2, logprobs=[0.0, -0.1, -0.2, 0.0, -0.3, -0.4],
                                  versions=[-1, 3, 3, -1, 5, 5])  # fmt: skip
    manifest = write_step(paths, 6, rows, producer="rollout", tokenizer="t")
    assert manifest.weight_versions is not None
    assert (manifest.weight_versions.min, manifest.weight_versions.max) == (3, 5)
    stats = step_stats(read_step(paths, 6))
    assert stats["min_version"] == 3 and stats["staleness_max"] == 3
    assert stats["staleness_mean"] == pytest.approx((3 + 1) / 2)
    assert stats["sampled_tokens"] == 4 + 4 and stats["tokens"] == 6 + 10


_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import write_step
    from unit.test_shards import make_rows
    rows = make_rows({rows}, step=0, prompt=200, sampled=200, seed={seed})
    print("ready", flush=True)
    write_step(RunPaths(Path({root!r})), 0, rows, producer="rollout", tokenizer="t", rows_per_part=20)
    print("done", flush=True)
    """
)


def _start_writer(root: Path, seed: int, rows: int = 1200) -> subprocess.Popen[str]:
    code = _WRITER.format(tests=str(REPO / "tests"), rows=rows, seed=seed, root=str(root))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _assert_step_old_or_absent(paths: RunPaths, old_ids: list[str] | None) -> None:
    """After a kill: the step is absent, or complete and exactly one of the versions ever written."""
    if paths.step_manifest(0).exists():
        ids = read_step(paths, 0, columns=["sample_id"]).column(0).to_pylist()
        assert ids == old_ids or (len(ids) == 1200 and ids[0].startswith("sample-")), ids[:3]
    else:
        assert list_complete_steps(paths) == []
        with pytest.raises(StepNotFound):
            read_step(paths, 0)


def test_writer_killed_while_parts_are_staged_leaves_no_step(paths: RunPaths) -> None:
    proc = _start_writer(paths.root, seed=1)
    deadline = time.monotonic() + 120
    try:
        # Kill once some parts exist in the staging dir: the writer is provably mid-step.
        while not list(paths.root.glob("trajectories/step_000000.*.tmp/part-*.parquet")):
            assert proc.poll() is None, "writer finished before any part was seen"
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    _assert_step_old_or_absent(paths, None)
    assert not paths.step_dir(0).exists()
    write_step(paths, 0, make_rows(3), producer="rollout", tokenizer="t")
    assert read_step(paths, 0).num_rows == 3
    assert not [p for p in paths.trajectories.iterdir() if p.name.endswith(".tmp") and "step_000000." in p.name
                and not p.name.endswith(".old.tmp")]  # fmt: skip


@pytest.mark.slow
def test_writer_killed_at_random_points_never_shows_a_torn_step(paths: RunPaths) -> None:
    old = make_rows(5, seed=99)
    write_step(paths, 0, old, producer="rollout", tokenizer="t")
    old_ids = [r.sample_id for r in old]
    rng = random.Random(1234)
    killed_mid_write = 0
    for attempt in range(6):
        proc = _start_writer(paths.root, seed=attempt)
        time.sleep(rng.uniform(0.0, 1.5))
        alive = proc.poll() is None
        with contextlib.suppress(ProcessLookupError):  # the writer may finish between poll and kill
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_mid_write += alive
        _assert_step_old_or_absent(paths, old_ids)
        if paths.step_manifest(0).exists():
            old_ids = read_step(paths, 0, columns=["sample_id"]).column(0).to_pylist()
    assert killed_mid_write >= 1
    write_step(paths, 0, old, producer="rollout", tokenizer="t")
    assert read_step(paths, 0).column("sample_id").to_pylist() == [r.sample_id for r in old]
