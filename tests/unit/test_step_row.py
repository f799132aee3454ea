"""A step's metrics row (`StepRow`) through its states, with real files: a trainer stopped in each state,
then a resume, leaves exactly one line per step in metrics/train.jsonl, with the values of the right attempt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.run.handoff import read_json, write_json_atomic
from pipeline.run.paths import COMPLETE, RunPaths
from pipeline.run.sinks import JsonlSink, NullSink
from pipeline.trainer.metrics import Timings
from pipeline.trainer.step_row import RowState, StepRow, logged_steps

S = RowState
STEPS = 3
CHECKPOINT_S = 2.5
ORDER = (S.COMPUTED, S.HELD, S.CHECKPOINTED, S.LOGGED, S.CLEARED)


def publication(verify_s: float) -> Timings:
    """The timings of a step whose publication took `verify_s` to verify (told apart in the rows)."""
    return Timings(publish_s=verify_s + 1.0, verify_s=verify_s)


def values(step: int, attempt: int) -> dict[str, Any]:
    """What step `step`'s update gave in attempt `attempt` (a step trained again gives other figures)."""
    return {"version": step + 1, "loss": 10.0 * attempt + step, "time_checkpoint_s": 0.0}


def train(paths: RunPaths, step: int, attempt: int, *, stop_in: RowState = S.CLEARED) -> StepRow:
    """Step `step`'s row through the trainer's order of calls, left as it is once it is in `stop_in`."""
    row = StepRow(paths, JsonlSink(paths.train_metrics), step, values(step, attempt), writes=True)
    moves = {
        S.HELD: row.hold,
        S.CHECKPOINTED: lambda: row.checkpointed(CHECKPOINT_S),
        S.LOGGED: lambda: row.log(publication(verify_s=attempt)),
        S.CLEARED: row.clear,
    }
    for state in ORDER[1 : ORDER.index(stop_in) + 1]:
        moves[state]()
    assert row.state is stop_in
    return row


def resume(paths: RunPaths, version: int) -> bool:
    """A trainer (attempt 2) resuming from `version`: publishes it, settles the row left behind, trains the rest."""
    row = StepRow.left_behind(paths, JsonlSink(paths.train_metrics), writes=True)
    logged = row is not None and row.settle(version, publication(verify_s=2.0))
    for step in range(version, STEPS):
        train(paths, step, attempt=2)
    return logged


def train_values(state: RowState) -> dict[str, Any]:
    """Step 1's held values (attempt 1) in `state`: the checkpoint's time arrives with CHECKPOINTED."""
    checkpoint_s = 0.0 if state is S.HELD else CHECKPOINT_S
    return {**values(1, attempt=1), "time_checkpoint_s": checkpoint_s}


def lines(paths: RunPaths) -> list[dict[str, Any]]:
    return [json.loads(line) for line in paths.train_metrics.read_text().splitlines()]


# (state the step-1 row of attempt 1 was stopped in, the version the resume starts from, the attempt whose
# update the logged row holds, its time_checkpoint_s, its verify_s: the publication it was logged after)
CASES = [
    (S.COMPUTED, 1, 2, CHECKPOINT_S, 2.0),  # checkpoint 2 not reached: step 1 trained again
    (S.HELD, 1, 2, CHECKPOINT_S, 2.0),  # stopped during checkpoint 2: trained again
    (S.HELD, 2, 1, 0.0, 2.0),  # stopped once checkpoint 2 was complete (a peer lost at its barrier)
    (S.CHECKPOINTED, 2, 1, CHECKPOINT_S, 2.0),  # in the evaluation hold or the publication
    (S.LOGGED, 2, 1, CHECKPOINT_S, 1.0),  # between the line and the file's removal
    (S.CLEARED, 2, 1, CHECKPOINT_S, 1.0),  # the step was over
]


@pytest.mark.parametrize(("stop_in", "version", "attempt", "checkpoint_s", "verify_s"), CASES)
def test_a_trainer_stopped_in_each_state_then_resumed_logs_each_step_once(
    tmp_path: Path, stop_in: RowState, version: int, attempt: int, checkpoint_s: float, verify_s: float
) -> None:
    paths = RunPaths(tmp_path)
    train(paths, 0, attempt=1)
    train(paths, 1, attempt=1, stop_in=stop_in)
    held = paths.pending_metrics.exists()
    assert held == (stop_in in (S.HELD, S.CHECKPOINTED, S.LOGGED))
    if held:  # the file holds what the resume needs: the step, and the checkpoint's time once it is known
        assert read_json(paths.pending_metrics) == {"step": 1, "values": train_values(stop_in)}

    logged_now = resume(paths, version)

    rows = lines(paths)
    assert [r["step"] for r in rows] == [0, 1, 2]
    step1 = rows[1]
    assert step1["loss"] == values(1, attempt)["loss"] and step1["version"] == 2
    assert step1["time_checkpoint_s"] == checkpoint_s and step1["verify_s"] == verify_s
    assert logged_now == (stop_in in (S.HELD, S.CHECKPOINTED) and version == 2)
    assert not paths.pending_metrics.exists()


def test_a_row_left_twice_is_logged_once(tmp_path: Path) -> None:
    """A resumed trainer stopped again after logging the row and before removing its file (and its own publication
    failing again, say): the next resume finds the step's line and does not write a second."""
    paths = RunPaths(tmp_path)
    train(paths, 0, attempt=1, stop_in=S.CHECKPOINTED)
    row = StepRow.left_behind(paths, JsonlSink(paths.train_metrics), writes=True)
    assert row is not None and row.state is S.LEFT_BEHIND and row.step == 0
    row.log(publication(verify_s=2.0))  # the second attempt stops here, before `clear`
    assert resume(paths, version=1) is False
    assert [(r["step"], r["verify_s"]) for r in lines(paths)] == [(0, 2.0), (1, 2.0), (2, 2.0)]


def test_a_row_of_a_step_that_will_be_trained_again_is_dropped(tmp_path: Path) -> None:
    """With no checkpoint due (nccl, `checkpoint_every` > 1) the resume starts before the held step."""
    paths = RunPaths(tmp_path)
    train(paths, 0, attempt=1, stop_in=S.CHECKPOINTED)
    assert resume(paths, version=0) is False
    assert [(r["step"], r["loss"]) for r in lines(paths)] == [(0, 20.0), (1, 21.0), (2, 22.0)]


def test_no_row_left_is_nothing_to_do(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert StepRow.left_behind(paths, JsonlSink(paths.train_metrics), writes=True) is None


@pytest.mark.parametrize("stop_in", ORDER)
def test_transitions_out_of_order_raise(tmp_path: Path, stop_in: RowState) -> None:
    """Every transition but the next one is refused, and refusing it changes nothing."""
    paths = RunPaths(tmp_path)
    row = train(paths, 0, attempt=1, stop_in=stop_in)
    calls = {
        S.HELD: row.hold,
        S.CHECKPOINTED: lambda: row.checkpointed(CHECKPOINT_S),
        S.LOGGED: lambda: row.log(Timings()),
        S.CLEARED: row.clear,
    }
    following = ORDER[ORDER.index(stop_in) + 1] if stop_in is not S.CLEARED else None
    for state, call in calls.items():
        if state is following:
            continue
        with pytest.raises(RuntimeError, match=f"step 0's metrics row is {stop_in.value} and cannot become"):
            call()
        assert row.state is stop_in
    assert logged_steps(paths) == ({0} if stop_in in (S.LOGGED, S.CLEARED) else set())


def test_only_the_writing_rank_touches_the_file(tmp_path: Path) -> None:
    """Ranks other than 0 go through the same states (their sink is a null one) and write no file."""
    paths = RunPaths(tmp_path)
    row = StepRow(paths, NullSink(), 0, values(0, 1), writes=False)
    row.hold()
    row.checkpointed(CHECKPOINT_S)
    assert not paths.pending_metrics.exists()
    write_json_atomic(paths.pending_metrics, {"step": 0, "values": values(0, 1)})  # rank 0's
    row.log(Timings())
    row.clear()
    assert row.state is S.CLEARED and paths.pending_metrics.exists()
    assert StepRow.left_behind(paths, JsonlSink(paths.train_metrics), writes=False) is None


def test_a_line_cut_mid_write_does_not_count_as_logged(tmp_path: Path) -> None:
    """`kill -9` inside the line's write: the step has no complete line, so its held row is still due."""
    paths = RunPaths(tmp_path)
    train(paths, 0, attempt=1)
    paths.train_metrics.write_text(paths.train_metrics.read_text() + '{"step": 1, "loss": 1')
    assert logged_steps(paths) == {0}


def test_a_line_cut_mid_write_is_dropped_and_the_held_row_logged_after_the_good_lines(tmp_path: Path) -> None:
    """`kill -9` inside step 1's line, its row held and checkpointed: the resumed sink cuts the fragment (gluing
    the re-logged line onto it lost both) and the resume logs the held row once, after step 0's line."""
    paths = RunPaths(tmp_path)
    train(paths, 0, attempt=1)
    train(paths, 1, attempt=1, stop_in=S.CHECKPOINTED)
    good = paths.train_metrics.read_text()
    paths.train_metrics.write_text(good + '{"step": 1, "loss": 1')
    assert resume(paths, version=2) is True
    rows = lines(paths)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["loss"] == values(1, attempt=1)["loss"]
    assert paths.train_metrics.read_text().startswith(good)


@pytest.mark.parametrize("checkpoint_complete", [True, False])
def test_a_redo_of_an_earlier_step_first_logs_the_row_a_stopped_run_left(
    tmp_path: Path, checkpoint_complete: bool
) -> None:
    """`arl stage train --step 0` on a run stopped after step 1's checkpoint, before its line: step 1 is finished
    (its checkpoint, version 2, is complete), so the redo logs its row before holding its own; without that
    checkpoint step 1 will be trained again and its row is dropped."""
    paths = RunPaths(tmp_path)
    train(paths, 0, attempt=1)
    train(paths, 1, attempt=1, stop_in=S.CHECKPOINTED)
    if checkpoint_complete:
        for marker in (paths.checkpoint_marker(2), paths.trainer_state_dir(2) / COMPLETE):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    row = StepRow.left_behind(paths, JsonlSink(paths.train_metrics), writes=True)
    assert row is not None and row.settle(0, publication(verify_s=2.0)) is checkpoint_complete
    train(paths, 0, attempt=2)  # the redo's own row goes through the file after the old one is settled
    assert [r["step"] for r in lines(paths)] == ([0, 1, 0] if checkpoint_complete else [0, 0])
    assert not paths.pending_metrics.exists()
