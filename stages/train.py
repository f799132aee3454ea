"""`arl stage train`: the trainer job (one process, or one per GPU under torchrun).

Reads the frozen config from the run dir, logs to `logs/train/attempt_<n>.log` (rank 0; other
ranks to `attempt_<n>.rank<r>.log`), then runs `pipeline.trainer.loop.run_trainer`: every remaining
step, or with `--step N` exactly step N from version N.
"""

from __future__ import annotations

import os
from pathlib import Path


def main(run_dir: Path, step: int | None = None) -> int:
    """Train; returns the exit code (errors propagate to the CLI, which prints them)."""
    from pipeline.logs import setup_logging
    from pipeline.paths import RunPaths

    paths = RunPaths(Path(run_dir))
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("ARL_ATTEMPT", "0")) or paths.next_attempt("train")
    log_file = paths.stage_log("train", attempt)
    if rank != 0:
        log_file = log_file.with_name(f"attempt_{attempt}.rank{rank}.log")
    setup_logging("train", log_file)

    from pipeline.trainer.loop import run_trainer

    return run_trainer(Path(run_dir), step)
