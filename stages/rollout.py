"""`arl stage rollout`: the rollout job (in-process proxy + the configured agent over the dataset).

Reads the frozen config from the run dir, logs to `logs/rollout/attempt_<n>.log`, then runs
`pipeline.rollout.loop.run_rollout`: every step from the first without a manifest, or with
`--step N` exactly step N (replacing it whole).
"""

from __future__ import annotations

import os
from pathlib import Path


def main(run_dir: Path, step: int | None = None) -> int:
    """Produce trajectories; returns the exit code (errors propagate to the CLI, which prints them)."""

    from pipeline.config import config_from_run_dir
    from pipeline.errors import ConfigError
    from pipeline.logs import run_async, setup_logging
    from pipeline.paths import RunPaths

    paths = RunPaths(Path(run_dir))
    attempt = int(os.environ.get("ARL_ATTEMPT", "0")) or paths.next_attempt("rollout")
    setup_logging("rollout", paths.stage_log("rollout", attempt))
    config = config_from_run_dir(run_dir)
    if config.rollout.external:
        raise ConfigError("rollout.external is true: outside agents feed this run; start `arl stage proxy` instead")

    from pipeline.rollout.loop import run_rollout

    run_async(run_rollout(config, paths, only_step=step))
    return 0
