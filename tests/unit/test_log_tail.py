"""What `arl launch --executor local` prints of a failed stage's log: the error's headline first."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from pipeline.launch.local import print_log_tail


def _printed(log: Path, lines: int = 12) -> list[str]:
    out = io.StringIO()
    print_log_tail(Console(file=out, width=200), log, lines=lines)
    return [line.strip() for line in out.getvalue().splitlines()]


def test_a_long_error_shows_its_headline_before_the_end_of_its_traceback(tmp_path: Path) -> None:
    log = tmp_path / "attempt_1.log"
    traceback = ["Traceback (most recent call last):", *(f'  File "agent.py", line {i}' for i in range(30))]
    headline = "error: step 0: 16 of 16 agent runs failed (error rate 1.00 > rollout.max_error_rate=0.5); the last one:"
    log.write_text("\n".join([*(f"INFO step line {i}" for i in range(40)), headline, *traceback, "KeyError: 'q'"]))
    printed = _printed(log)
    assert printed[0] == headline, "the headline comes first, not a line from the middle of the traceback"
    assert printed[1].startswith("... (22 lines; the whole log: ") and printed[-1] == "KeyError: 'q'"
    assert len(printed) == 12


def test_a_short_error_is_shown_whole_from_its_headline(tmp_path: Path) -> None:
    log = tmp_path / "attempt_1.log"
    log.write_text("\n".join(["INFO a", "INFO b", "error: no such dataset", "  (see docs/rollout.md)"]))
    assert _printed(log) == ["error: no such dataset", "(see docs/rollout.md)"]


def test_a_crash_without_an_error_line_shows_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "attempt_1.log"
    log.write_text("\n".join([*(f"line {i}" for i in range(20)), "Traceback (most recent call last):", "OSError: x"]))
    assert _printed(log, lines=3) == ["line 19", "Traceback (most recent call last):", "OSError: x"]
