"""What every stage job starts with, built in one place: the `StageContext` its pipeline function takes.

The four stage entry functions share one signature, `run_<stage>(ctx: StageContext)`:
`pipeline.engine.inference.servers.run_inference`, `pipeline.rollout.loop.run_rollout`,
`pipeline.rollout.external.run_external` (the `proxy` stage) and `pipeline.trainer.loop.run_trainer`.
`open_stage` is the preamble of `stages/<name>.py`; tests and embedders build a `StageContext` directly.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.errors import ConfigError
from pipeline.run.config import config_from_run_dir
from pipeline.run.logs import setup_logging
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig

StageName = Literal["inference", "rollout", "proxy", "train"]


@dataclass(frozen=True)
class StageContext:
    """One stage process: which stage, its run dir and frozen config, and which attempt and rank it is."""

    name: StageName
    paths: RunPaths
    config: ArlConfig
    attempt: int = 1
    """The attempt number in `logs/<stage>/attempt_<n>.log` (set by `arl launch`, else the next free one)."""
    only_step: int | None = None
    """`--step N`: redo exactly step N, then exit; `None` = every remaining step."""
    rank: int = 0
    """Process rank under torchrun (`RANK`); every other stage runs one process, rank 0."""

    @classmethod
    def from_run_dir(
        cls, name: StageName, run_dir: Path, *, only_step: int | None = None, attempt: int = 1, rank: int = 0
    ) -> StageContext:
        """A context over the frozen config in `run_dir` (no logging set up: for tests and embedders)."""
        return cls(name, RunPaths(Path(run_dir)), config_from_run_dir(run_dir), attempt, only_step, rank)


def stages_for(config: ArlConfig) -> list[StageName]:
    """The stages of a run: the built-in rollout, or the standalone proxy when agents are external."""
    return ["inference", "proxy" if config.rollout.source == "external" else "rollout", "train"]


# Why a stage that is not among `stages_for(config)` is refused, and which one to start instead.
_NOT_THIS_RUN = {
    "rollout": "rollout.source is external: outside agents feed this run; start `arl stage proxy` instead",
    "proxy": "rollout.source is agent: the rollout stage runs this run's agents; start `arl stage rollout` instead",
}


def open_stage(name: StageName, run_dir: Path, step: int | None = None) -> StageContext:
    """The stage preamble: the frozen config, attempt number, rank-aware log file and logging.

    The config is read first: a directory that is not a run dir is refused before a `logs/` is
    created in it (under `arl launch` the error reaches the attempt log through stderr anyway).
    """
    paths = RunPaths(Path(run_dir))
    config = config_from_run_dir(paths.root)
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("ARL_ATTEMPT", "0")) or paths.next_attempt(name)
    setup_logging(name, stage_log_file(paths, name, attempt, rank))
    if name not in stages_for(config):
        raise ConfigError(_NOT_THIS_RUN[name])
    if config.metrics.wandb is not None and name != "inference":
        from pipeline.run.sinks import import_wandb

        import_wandb()  # a missing `wandb` extra fails the stage here, before a model is loaded or a server started
    if step is not None and name == "inference":
        logging.getLogger("arl").info("--step %d ignored: the inference stage serves every step", step)
        step = None
    return StageContext(name, paths, config, attempt=attempt, only_step=step, rank=rank)


def stage_log_file(paths: RunPaths, name: str, attempt: int, rank: int) -> Path:
    """`logs/<stage>/attempt_<n>.log` for rank 0; `attempt_<n>.rank<r>.log` for the other trainer ranks."""
    log_file = paths.stage_log(name, attempt)
    return log_file if rank == 0 else log_file.with_name(f"attempt_{attempt}.rank{rank}.log")
