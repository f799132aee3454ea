"""`arl stage rollout`: the rollout job (in-process proxy + the configured agent over the dataset).

Reads the frozen config from the run dir, logs to `logs/rollout/attempt_<n>.log`, then runs
`pipeline.rollout.loop.run_rollout`: every step from the first without a manifest, or with
`--step N` exactly step N (replacing it whole). See docs/rollout.md.
"""

from __future__ import annotations

from pathlib import Path


def main(run_dir: Path, step: int | None = None) -> int:
    """Produce trajectories; returns the exit code (errors propagate to the CLI, which prints them)."""
    from pipeline.run.logs import run_async
    from pipeline.run.stage import open_stage

    ctx = open_stage("rollout", run_dir, step)

    from pipeline.rollout.loop import run_rollout

    run_async(run_rollout(ctx))
    return 0
