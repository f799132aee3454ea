"""Progress of one step: a rich progress bar on a terminal, a log line every few seconds otherwise
(a Slurm log full of carriage returns is unreadable)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger("arl.rollout")


class StepProgress:
    def __init__(self, step: int, total: int, *, every_s: float = 10.0) -> None:
        self.step = step
        self.total = total
        self.done = 0
        self.every_s = every_s
        self.last = time.monotonic()
        self.bar: Any = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn(f"step {step}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("runs", total=total, info="")

    def advance(self, tally: Any) -> None:
        self.done += 1
        info = f"errors {tally.agent_errors} rejected {tally.rejected}"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            log.info("step %d: %d/%d runs done (%s)", self.step, self.done, self.total, info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
