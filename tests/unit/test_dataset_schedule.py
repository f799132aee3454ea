"""Datasets (JSONL, Parquet, save_to_disk) and the deterministic step schedule behind exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.agents.dataset import DataError, Schedule, check_cursor, load_rows, write_cursor
from schemas.config import DatasetConfig


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"q": f"question {i}", "i": i}) + "\n" for i in range(n)))
    return path


def test_jsonl_parquet_and_saved_dataset_agree(tmp_path: Path) -> None:
    rows = [{"q": f"question {i}", "i": i} for i in range(5)]
    jsonl = _jsonl(tmp_path / "d.jsonl", 5)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "flat"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    for config in (
        DatasetConfig(path=str(jsonl)),
        DatasetConfig(path=str(parquet)),
        DatasetConfig(path=str(tmp_path / "flat")),
        DatasetConfig(path=str(tmp_path / "dd"), split="train"),
    ):
        loaded = load_rows(config)
        assert len(loaded) == 5
        assert [loaded[i] for i in range(5)] == rows


def test_dataset_errors(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"a": 1}])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"set the dataset's split"):
        load_rows(DatasetConfig(path=str(tmp_path / "dd")))
    with pytest.raises(DataError, match=r"no split 'test'.*train"):
        load_rows(DatasetConfig(path=str(tmp_path / "dd"), split="test"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        load_rows(DatasetConfig(path=str(bad)))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_rows(DatasetConfig(path=str(tmp_path / "empty.jsonl")))
    with pytest.raises(DataError, match="does not exist"):
        load_rows(DatasetConfig(path=str(tmp_path / "missing.jsonl")))


def test_schedule_covers_each_epoch_once_and_reshuffles(tmp_path: Path) -> None:
    rows = load_rows(DatasetConfig(path=str(_jsonl(tmp_path / "d.jsonl", 10))))
    schedule = Schedule(rows, batch_size=4, shuffle=True, seed=7)
    positions = [p for k in range(5) for p in schedule.prompts(k)]  # 20 prompts = 2 epochs
    assert [p.position for p in positions] == list(range(20))
    epoch0 = [p.index for p in positions if p.epoch == 0]
    epoch1 = [p.index for p in positions if p.epoch == 1]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # each epoch has its own order
    assert all(p.data["i"] == p.index for p in positions)


def test_step_prompts_depend_only_on_step_and_config(tmp_path: Path) -> None:
    rows = load_rows(DatasetConfig(path=str(_jsonl(tmp_path / "d.jsonl", 7))))
    straight = Schedule(rows, batch_size=3, shuffle=True, seed=1)
    through = [[p.index for p in straight.prompts(k)] for k in range(6)]
    fresh = Schedule(rows, batch_size=3, shuffle=True, seed=1)  # a resumed process
    assert [p.index for p in fresh.prompts(4)] == through[4]
    assert [[p.index for p in fresh.prompts(k)] for k in (5, 2, 0)] == [through[5], through[2], through[0]]
    other_seed = Schedule(rows, batch_size=3, shuffle=True, seed=2)
    assert [[p.index for p in other_seed.prompts(k)] for k in range(6)] != through
    ordered = Schedule(rows, batch_size=3, shuffle=False, seed=1)
    assert [p.index for p in ordered.prompts(2)] == [6, 0, 1]


def test_cursor_records_and_refuses_a_changed_schedule(tmp_path: Path) -> None:
    rows = load_rows(DatasetConfig(path=str(_jsonl(tmp_path / "d.jsonl", 7))))
    schedule = Schedule(rows, batch_size=3, shuffle=True, seed=1)
    cursor = tmp_path / "state" / "rollout_cursor.json"
    assert check_cursor(cursor, schedule) is None
    write_cursor(cursor, schedule, 2, "d.jsonl")
    record = check_cursor(cursor, schedule)
    assert record is not None
    assert (record["last_step"], record["next_position"], record["epoch"], record["offset_in_epoch"]) == (2, 9, 1, 2)
    write_cursor(cursor, schedule, 0, "d.jsonl")  # redoing an earlier step keeps the later record
    assert json.loads(cursor.read_text())["last_step"] == 2
    grown = load_rows(DatasetConfig(path=str(_jsonl(tmp_path / "d2.jsonl", 8))))
    with pytest.raises(DataError, match=r"dataset_len: 7 -> 8"):
        check_cursor(cursor, Schedule(grown, batch_size=3, shuffle=True, seed=1))
