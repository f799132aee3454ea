"""One step's metrics row, from its computation to its line in metrics/train.jsonl.

A step's checkpoint moves the resume point past the step, so a trainer that stops after it (a peer
lost at its barrier, a publication that failed to verify) is never given the step again: its row
must already be on disk, in `state/trainer/pending_metrics.json`, for the resumed trainer to log.
`StepRow` owns that row and that file; the trainer moves it through its states in the order below.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
from typing import Any

from pipeline.run.handoff import read_json, write_json_atomic
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import MetricsSink
from pipeline.trainer.checkpoint import state_complete
from pipeline.trainer.metrics import Timings, publish_figures

log = logging.getLogger("arl.trainer")


class RowState(enum.Enum):
    """Where a step's row is; the `StepRow` docstring says what a crash in each state leaves."""

    COMPUTED = "computed"
    HELD = "held"
    CHECKPOINTED = "checkpointed"
    LOGGED = "logged"
    CLEARED = "cleared"
    LEFT_BEHIND = "left behind"


# The states each state may be entered from: a call out of order is a bug in the trainer, never skipped over.
_ENTERED_FROM = {
    RowState.HELD: {RowState.COMPUTED},
    RowState.CHECKPOINTED: {RowState.HELD},
    RowState.LOGGED: {RowState.CHECKPOINTED, RowState.LEFT_BEHIND},
    RowState.CLEARED: {RowState.LOGGED, RowState.LEFT_BEHIND},
}


class StepRow:
    """Step `step`'s metrics row and its file `paths.pending_metrics` (written by rank 0 only: `writes`).

    The trainer calls the transitions in this order (`Trainer.train_step`):

    ============  =========================================  ==================================================
    state         entered by                                 a crash in it leaves, and the resume then does
    ============  =========================================  ==================================================
    COMPUTED      `StepRow(...)`, after the update           no file of this step; the checkpoint is not
                                                             complete, so the step is trained again and its
                                                             row computed again
    HELD          `hold()`: the file written, before the     the file; killed during the checkpoint, the step
                  checkpoint (`time_checkpoint_s` 0)         is trained again and the file dropped; killed
                                                             once it is complete (a peer lost at its barrier),
                                                             the resume logs the row as it is
    CHECKPOINTED  `checkpointed(s)`: the file rewritten      the file, through the evaluation hold and the
                  with the checkpoint's time (0 when none    publication; the resume logs the row (with its
                  was due), after the checkpoint             own publication's figures); with no checkpoint
                                                             due the step is trained again, the file dropped
    LOGGED        `log(timings)`: the publication's          the line in train.jsonl and the file; the resume
                  figures added, the line appended to the    finds the step's line and only removes the file
                  sinks                                      (with no checkpoint due the step is trained and
                                                             logged again: the later line wins)
    CLEARED       `clear()`: the file removed                the line only
    ============  =========================================  ==================================================

    On start the trainer settles what an earlier attempt left: `left_behind()` reads the file (state
    LEFT_BEHIND: that attempt's HELD, CHECKPOINTED or LOGGED) and `settle(version)` logs the row when its step
    is `version - 1` (the checkpoint resumed from is this step's, so no attempt trains it again) and train.jsonl
    has no line of it yet; any other row is of a step that will be trained again. Either way the file is then
    removed. A `--step N` redo on a stopped run settles the same way first: the row is logged when its step's
    checkpoint is complete (that step is finished), before the redo's own row takes the file. So a step's row is
    logged once and never lost; a line a `kill -9` cut mid-write is dropped by the next sink that opens the file
    (`pipeline/run/sinks.py`), and the row held for it is logged again.
    """

    def __init__(self, paths: RunPaths, sink: MetricsSink, step: int, values: dict[str, Any], *, writes: bool) -> None:
        self.paths, self.sink, self.step, self.writes = paths, sink, step, writes
        self.values = dict(values)
        self.state = RowState.COMPUTED

    @classmethod
    def left_behind(cls, paths: RunPaths, sink: MetricsSink, *, writes: bool) -> StepRow | None:
        """The row an earlier attempt left in the file (state LEFT_BEHIND), or None: no file, or not rank 0."""
        if not writes or not paths.pending_metrics.exists():
            return None
        held = read_json(paths.pending_metrics)
        row = cls(paths, sink, held["step"], held["values"], writes=writes)
        row.state = RowState.LEFT_BEHIND
        return row

    # -- the transitions, in order ------------------------------------------------------------------
    def hold(self) -> None:
        """COMPUTED -> HELD: keep the row on disk before the step's checkpoint can move the resume point past it."""
        self._enter(RowState.HELD)
        self._write()

    def checkpointed(self, checkpoint_s: float) -> None:
        """HELD -> CHECKPOINTED: the checkpoint is over (or was not due); the held row gets its time."""
        self._enter(RowState.CHECKPOINTED)
        self.values["time_checkpoint_s"] = checkpoint_s
        self._write()

    def log(self, timings: Timings) -> dict[str, Any]:
        """CHECKPOINTED or LEFT_BEHIND -> LOGGED: the row with `timings`' publication figures, to the sinks.
        Returns what was logged."""
        self._enter(RowState.LOGGED)
        values = {**self.values, **publish_figures(timings)}
        self.sink.log(self.step, values)
        return values

    def clear(self) -> None:
        """LOGGED or LEFT_BEHIND -> CLEARED: the row's line is written (or it is dropped): remove the file."""
        self._enter(RowState.CLEARED)
        if self.writes:
            self.paths.pending_metrics.unlink(missing_ok=True)

    def settle(self, version: int, timings: Timings) -> bool:
        """LEFT_BEHIND -> (LOGGED ->) CLEARED, by a trainer resuming from `version` that has just published it
        (`timings`). True when the row was logged now (see the class docstring for when)."""
        # Normally the row's step is the one just before the resume point. A `--step N` redo on a stopped run
        # resumes elsewhere, yet the row's step is finished all the same when its checkpoint is complete.
        finished = self.step == version - 1 or resumable(self.paths, self.step + 1)
        due = finished and self.step not in logged_steps(self.paths)
        if due:
            log.info("step %d's metrics were held by a publication that did not end; logged now", self.step)
            self.log(timings)
        self.clear()
        return due

    # -----------------------------------------------------------------------------------------------
    def _enter(self, state: RowState) -> None:
        if self.state not in _ENTERED_FROM[state]:
            raise RuntimeError(
                f"step {self.step}'s metrics row is {self.state.value} and cannot become {state.value}: the order "
                "is computed -> held -> checkpointed -> logged -> cleared (a row left behind: logged or cleared)"
            )
        self.state = state

    def _write(self) -> None:
        if self.writes:
            write_json_atomic(self.paths.pending_metrics, {"step": self.step, "values": self.values})


def resumable(paths: RunPaths, version: int) -> bool:
    """A complete checkpoint and trainer state of `version`: a point a resume may start from (`resume_point`)."""
    return paths.checkpoint_marker(version).exists() and state_complete(paths, version)


def logged_steps(paths: RunPaths) -> set[int]:
    """The steps metrics/train.jsonl holds a complete line of (a line cut by `kill -9` does not count)."""
    try:
        lines = paths.train_metrics.read_text().splitlines()
    except FileNotFoundError:
        return set()
    steps = set()
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            steps.add(int(json.loads(line)["step"]))
    return steps
