"""Every path of the run directory (docs/run-directory.md), built in one place.

No other module joins run-dir path strings: they ask `RunPaths`. Steps are zero-padded so that
lexical order is step order. Marker and file names are defined once, here.

Checkpoint numbering: `checkpoints/step_%06d` holds weight *version* k (the weights after k
optimizer steps), i.e. the output of trainer step k-1. `LATEST` holds the newest complete version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "_MANIFEST.json"
COMPLETE = "_COMPLETE"
MERGED = "merged"
"""The full-weight model inside a LoRA run's checkpoint (whose top level is the adapter)."""
TMP_SUFFIX = ".tmp"
STAGES = ("inference", "rollout", "proxy", "train")
_STEP_RE = re.compile(r"^step_(\d{6,})$")
_ATTEMPT_RE = re.compile(r"^attempt_(\d+)\.log$")
ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter config: a checkpoint holding it is a LoRA adapter (its base is elsewhere)."""


def is_adapter_dir(path: Path) -> bool:
    """Whether `path` is a PEFT LoRA adapter directory (a LoRA run's checkpoint) rather than a full model."""
    return (path / ADAPTER_CONFIG).is_file()


def step_name(step: int) -> str:
    """`step_000012` for 12; refuses negatives (a negative step is always a bug upstream)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}"


def parse_step_name(name: str) -> int | None:
    """12 for `step_000012`; None for anything else (temp dirs, stray files)."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class RunPaths:
    """Paths of one run directory `<fileroot>/<experiment_name>/<trial_name>/`."""

    root: Path

    @classmethod
    def from_config(cls, fileroot: str | Path, experiment_name: str, trial_name: str) -> RunPaths:
        return cls(Path(fileroot) / experiment_name / trial_name)

    # -- top level ------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs.json"

    # -- registry -------------------------------------------------------------------------
    @property
    def registry(self) -> Path:
        return self.root / "registry"

    @property
    def inference_registry(self) -> Path:
        return self.registry / "inference"

    def inference_entry(self, server: str) -> Path:
        return self.inference_registry / f"{server}.json"

    @property
    def proxy_registry(self) -> Path:
        return self.registry / "proxy"

    def proxy_entry(self, name: str) -> Path:
        return self.proxy_registry / f"{name}.json"

    @property
    def weight_sync(self) -> Path:
        return self.registry / "weight_sync.json"

    # -- trajectories ---------------------------------------------------------------------
    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    def step_dir(self, step: int) -> Path:
        return self.trajectories / step_name(step)

    def step_manifest(self, step: int) -> Path:
        return self.step_dir(step) / MANIFEST

    # -- evaluation -----------------------------------------------------------------------
    @property
    def evaluations(self) -> Path:
        return self.root / "eval"

    def eval_dir(self, version: int, set_name: str) -> Path:
        """The shards of one evaluation: weight version `version` on the eval set `set_name`."""
        return self.evaluations / step_name(version) / set_name

    @staticmethod
    def shard_name(producer: str, seq: int) -> str:
        return f"part-{producer}-{seq:05d}.parquet"

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_dir(self, version: int) -> Path:
        return self.checkpoints / step_name(version)

    def weights_dir(self, version: int) -> Path:
        """The full Hugging Face model of checkpoint `version` (what engines load and `arl eval` scores): the
        checkpoint itself, or in a LoRA run, whose checkpoint is the adapter, its `merged/` subdirectory."""
        merged = self.checkpoint_dir(version) / MERGED
        return merged if merged.is_dir() else self.checkpoint_dir(version)

    def checkpoint_marker(self, version: int) -> Path:
        return self.checkpoint_dir(version) / COMPLETE

    @property
    def latest(self) -> Path:
        return self.checkpoints / "LATEST"

    # -- replays (`arl replay`) -----------------------------------------------------------
    @property
    def replays(self) -> Path:
        return self.root / "replay"

    def replay_file(self, step: int) -> Path:
        """Per-token engine vs trainer log-probs of step `step` (`arl replay` writes them, the viewer reads them)."""
        return self.replays / f"{step_name(step)}.parquet"

    # -- state ----------------------------------------------------------------------------
    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def rollout_state(self) -> Path:
        return self.state / "rollout_cursor.json"

    @property
    def pending_metrics(self) -> Path:
        """A trainer step's metrics row, from before its checkpoint until it is logged (`trainer.step_row.StepRow`)."""
        return self.state / "trainer" / "pending_metrics.json"

    def trainer_state_dir(self, version: int) -> Path:
        """Optimizer/scheduler/RNG state that goes with checkpoint `version`."""
        return self.state / "trainer" / step_name(version)

    @property
    def quarantine(self) -> Path:
        """`<server>.json` requests from the trainer: take that inference server out and recover it."""
        return self.state / "quarantine"

    def quarantine_entry(self, server: str) -> Path:
        return self.quarantine / f"{server}.json"

    @property
    def retired(self) -> Path:
        """`<server>.json` notes: that server's inference stage is gone (replaced by a newer attempt), so it will
        never come back; the trainer stops waiting for it."""
        return self.state / "retired"

    def retired_entry(self, server: str) -> Path:
        return self.retired / f"{server}.json"

    @property
    def weight_version(self) -> Path:
        """The newest version every inference server has confirmed (written by the trainer)."""
        return self.state / "weight_version.json"

    @property
    def proxy_admin_key(self) -> Path:
        return self.state / "proxy_admin_key"

    @property
    def proxy_spool(self) -> Path:
        """Finished outside sessions the standalone proxy stage has not published yet (one file each)."""
        return self.state / "proxy_spool"

    def proxy_spool_entry(self, session_id: str) -> Path:
        return self.proxy_spool / f"{session_id}.json"

    # -- metrics and logs -----------------------------------------------------------------
    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def rollout_metrics(self) -> Path:
        return self.metrics / "rollout.jsonl"

    @property
    def train_metrics(self) -> Path:
        return self.metrics / "train.jsonl"

    @property
    def eval_metrics(self) -> Path:
        return self.metrics / "eval.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.metrics / "tb"

    @property
    def wandb(self) -> Path:
        """W&B's own directory (`wandb.init(dir=metrics)`): offline runs, debug logs, and our run ids."""
        return self.metrics / "wandb"

    def wandb_run_id(self, stage: str) -> Path:
        """The id of `stage`'s W&B run, kept so a resumed stage continues the same W&B run."""
        return self.wandb / f"{stage}.run_id"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def stage_logs(self, stage: str) -> Path:
        return self.logs / stage

    def stage_log(self, stage: str, attempt: int) -> Path:
        return self.stage_logs(stage) / f"attempt_{attempt}.log"

    def latest_log(self, stage: str) -> Path:
        """The newest attempt's log of `stage` (attempt_1 if none exists yet): named in wait errors."""
        attempts = [int(m.group(1)) for p in _listdir(self.stage_logs(stage)) if (m := _ATTEMPT_RE.match(p.name))]
        return self.stage_log(stage, max(attempts, default=1))

    def next_attempt(self, stage: str) -> int:
        attempts = [int(m.group(1)) for p in _listdir(self.stage_logs(stage)) if (m := _ATTEMPT_RE.match(p.name))]
        return max(attempts, default=0) + 1

    def sbatch_script(self, stage: str) -> Path:
        """The stage's sbatch script written by `arl launch --dry-run` (also runs with plain `sbatch`)."""
        return self.root / "sbatch" / f"{stage}.sbatch"

    @property
    def self_recorded_jobs(self) -> Path:
        """One file per Slurm job that recorded itself (a prepared script submitted with plain sbatch)."""
        return self.root / "sbatch" / "self_recorded"

    @property
    def submitit_dir(self) -> Path:
        """submitit's pickles and results for the run's jobs."""
        return self.root / "sbatch" / "submitit"

    @property
    def reward_curve(self) -> Path:
        return self.root / "reward_curve.png"

    # -- scanning -------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        """Trajectory steps whose manifest exists, ascending."""
        return _complete(self.trajectories, MANIFEST)

    def complete_checkpoints(self) -> list[int]:
        """Checkpoint versions whose `_COMPLETE` marker exists, ascending."""
        return _complete(self.checkpoints, COMPLETE)


def _listdir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except FileNotFoundError:
        return []


def _complete(parent: Path, marker: str) -> list[int]:
    found = []
    for child in _listdir(parent):
        step = parse_step_name(child.name)
        if step is not None and (child / marker).exists():
            found.append(step)
    return sorted(found)
