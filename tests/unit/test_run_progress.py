"""What a person watches of a run: the step feed, the step line, the table that fits its console."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from pipeline.run import progress
from pipeline.run.console import people_console
from pipeline.run.paths import RunPaths
from pipeline.run.progress import COLUMNS, StepFeed, StepRecord, step_line, step_table

ROLLOUT = {"reward_mean": 0.2125, "reward_std": 0.1, "sample_len_mean": 41.25, "sampled_tokens": 40, "samples": 8,
           "agent/exact_correct": 0.375}  # fmt: skip
TRAIN = {"tokens_per_s": 1234.5, "staleness_mean": 0.5, "loss": -0.01234, "version": 4}


def _append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(text)


def test_feed_hands_out_each_trained_step_once_as_its_lines_arrive(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    feed = StepFeed(paths)
    assert feed.poll() == []  # no metrics files yet
    _append(paths.rollout_metrics, json.dumps({"step": 0, **ROLLOUT}) + "\n")
    assert feed.poll() == []  # rolled out, not trained: not a completed step
    _append(paths.train_metrics, json.dumps({"step": 0, **TRAIN}) + "\n" + '{"step": 1, "lo')  # step 1 half-written
    (first,) = feed.poll()
    assert first.step == 0 and first.rollout["reward_mean"] == 0.2125 and first.train["loss"] == -0.01234
    _append(paths.rollout_metrics, json.dumps({"step": 1, **ROLLOUT}) + "\n")
    _append(paths.train_metrics, 'ss": 0.5}\n')
    assert [r.step for r in feed.poll()] == [1]
    assert feed.poll() == []
    _append(paths.rollout_metrics, json.dumps({"step": 2, **ROLLOUT}) + "\n")
    _append(paths.train_metrics, "not json, cut by kill -9\n" + json.dumps({"step": 2, **TRAIN}) + "\n")
    assert [r.step for r in feed.poll()] == [2]
    assert [r.step for r in feed.records()] == [0, 1, 2]
    assert StepFeed(paths, from_now=True).poll() == []  # a resumed launch does not repeat earlier steps


def test_a_step_trained_before_its_rollout_row_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rollout logs a step's row just after publishing its shards, so the trainer can log first: the step is
    handed out with its reward once the rollout row arrives, not before and without it (a launch printed a step
    line without its reward this way), and later steps wait behind it."""
    paths = RunPaths(tmp_path / "run")
    feed = StepFeed(paths)
    _append(paths.train_metrics, json.dumps({"step": 0, **TRAIN}) + "\n" + json.dumps({"step": 1, **TRAIN}) + "\n")
    _append(paths.rollout_metrics, json.dumps({"step": 1, **ROLLOUT}) + "\n")
    assert feed.poll() == []
    _append(paths.rollout_metrics, json.dumps({"step": 0, **ROLLOUT}) + "\n")
    records = feed.poll()
    assert [r.step for r in records] == [0, 1] and all(r.rollout["reward_mean"] == 0.2125 for r in records)
    _append(paths.train_metrics, json.dumps({"step": 2, **TRAIN}) + "\n")
    assert feed.poll() == []
    assert [(r.step, r.rollout) for r in feed.poll(final=True)] == [(2, {})]  # the run ended: shown without it
    _append(paths.train_metrics, json.dumps({"step": 3, **TRAIN}) + "\n")
    monkeypatch.setattr(progress, "ROLLOUT_ROW_WAIT_S", 0.0)  # a rollout row that never comes holds it no longer
    assert [r.step for r in feed.poll()] == [3]


def test_step_line_names_every_figure_and_the_version_rule() -> None:
    line = step_line(StepRecord(3, ROLLOUT, TRAIN))
    assert line == (
        "step 3: reward 0.212 (std 0.100)  exact-correct 0.375  length 41.2 tokens (5.0 sampled)  "
        "train 1,234 tokens/s  staleness 0.50  loss -0.0123  -> weight version 4"
    )
    assert step_line(StepRecord(5, {}, {"loss": 0.5})) == "step 5: loss 0.5000  -> weight version 6"


def test_the_table_drops_columns_to_fit_and_never_cuts_a_header() -> None:
    records = [StepRecord(s, ROLLOUT, TRAIN) for s in range(995, 1000)]
    every = [c.header for c in COLUMNS]
    for width in (120, 100, 80, 60, 40, 20):
        console = Console(record=True, width=width, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(step_table(records, console))
        lines = console.export_text().splitlines()
        assert all(len(line) <= width for line in lines), (width, lines)
        headers = [h.strip() for h in lines[1].strip("┃").split("┃")]
        assert set(headers) <= set(every), (width, headers)  # whole headers only
        assert headers[0] == "step" and headers == [h for h in every if h in headers]  # their order kept
        if width == 120:
            assert headers == every
        if width == 100:  # the least important goes first
            assert "exact" in headers and "staleness" not in headers
        if width == 60:
            assert "reward" in headers and "version" in headers and "staleness" not in headers


def test_people_console_never_hard_wraps_text_on_a_pipe(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("COLUMNS", raising=False)
    out = tmp_path / "out.txt"
    with open(out, "w") as handle:
        console = people_console(file=handle)
        assert console.width == 100
        long = "sbatch " + "/very/long/directory" * 12 + "/train.sbatch"
        console.print(long)
    assert out.read_text() == long + "\n"
