"""`arl stage train`: the trainer job (one process, or one per GPU under torchrun).

Reads the frozen config from the run dir, logs to `logs/train/attempt_<n>.log` (rank 0; other
ranks to `attempt_<n>.rank<r>.log`), then runs `pipeline.trainer.loop.run_trainer`: every remaining
step, or with `--step N` exactly step N from version N. See docs/trainer.md.
"""

from __future__ import annotations

from pathlib import Path


def main(run_dir: Path, step: int | None = None) -> int:
    """Train; returns the exit code (errors propagate to the CLI, which prints them)."""
    from pipeline.run.stage import open_stage

    ctx = open_stage("train", run_dir, step)

    from pipeline.trainer.loop import run_trainer

    return run_trainer(ctx)
