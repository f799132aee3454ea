"""The step timeline `arl status` prints: intervals from both metrics rows, parts inside their parent,
what no interval covers as `other`."""

from __future__ import annotations

import pytest

from pipeline.run.progress import StepRecord
from pipeline.run.timeline import ROLLOUT, TRAIN, stage_timeline, timeline_lines

ROLLOUT_ROW = {"time_wait_weights_s": 0.25, "time_runs_s": 1.0, "time_agent_start_s": 0.5, "time_write_s": 0.25,
               "time_step_s": 1.75}  # fmt: skip
TRAIN_ROW = {"time_wait_s": 0.5, "time_load_s": 0.0, "time_compute_s": 1.0, "time_checkpoint_s": 0.25,
             "time_publish_s": 0.5, "weight_sync_s": 0.125, "verify_s": 0.25, "time_step_s": 3.0}  # fmt: skip


def test_parts_are_not_counted_twice_and_the_rest_is_other() -> None:
    record = StepRecord(4, ROLLOUT_ROW, TRAIN_ROW)
    rollout = {label: seconds for label, seconds, _ in stage_timeline(record, ROLLOUT)}
    assert rollout["other"] == pytest.approx(0.25)  # 1.75 - (0.25 + 1.0 + 0.25); start-up is part of the runs
    train = {label: seconds for label, seconds, _ in stage_timeline(record, TRAIN)}
    assert train["other"] == pytest.approx(0.75) and train["step"] == 3.0


def test_lines_put_parts_in_parentheses_after_their_interval() -> None:
    lines = timeline_lines(StepRecord(4, ROLLOUT_ROW, TRAIN_ROW))
    assert lines[0].split() == ["rollout", "wait", "for", "weights", "0.25", "·", "agent", "runs", "1.00",
                                "(agent", "start-up,", "mean", "0.50)", "·", "shard", "write", "+", "publish",
                                "0.25", "·", "other", "0.25", "·", "step", "1.75"]  # fmt: skip
    assert "publication 0.50 (server reload 0.12, verification 0.25) · other 0.75 · step 3.00" in lines[1]


def test_rows_without_step_times_have_no_timeline() -> None:
    assert timeline_lines(StepRecord(0, {"reward_mean": 0.1}, {"loss": 0.0})) == []
    assert len(timeline_lines(StepRecord(0, {}, TRAIN_ROW))) == 1


def test_a_stage_with_its_cpu_time_says_so_at_the_end_of_its_line() -> None:
    lines = timeline_lines(StepRecord(4, {**ROLLOUT_ROW, "cpu_s": 1.625}, TRAIN_ROW))
    assert lines[0].endswith("step 1.75 · CPU 1.62") and "CPU" not in lines[1]
