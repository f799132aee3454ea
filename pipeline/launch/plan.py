"""What each stage job runs, and with which resources.

A stage job is `arl stage <name> --run-dir D` (docs/cli.md), nothing more: the stages coordinate only
through the run dir, so the launcher never passes them anything else and the order of
submission never matters. Two stages may span nodes: the trainer (with more than one GPU or node it
runs under torchrun, one torchrun per node started by `srun`, meeting at a c10d rendezvous on the
job's first node) and the inference servers (`srun` runs the stage once per node, each copy starting
its node's servers: `pipeline.engine.inference.placement`).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.run.paths import RunPaths
from pipeline.run.stage import stages_for
from schemas.config import ArlConfig, StageResources

LAUNCH_ORDER = ("inference", "rollout", "proxy", "train")


@dataclass(frozen=True)
class StagePlan:
    """One stage job: its name, what one node runs, and the resources it asks for."""

    stage: str
    argv: list[str]
    """The command one node runs (a shell-free argv; for torchrun, `bash -c '...'`)."""
    resources: StageResources
    setup: list[str] = field(default_factory=list)
    """Shell lines run first: `cluster.setup`, then the stage's own `setup`."""
    torchrun: bool = False
    """The command expects MASTER_ADDR / MASTER_PORT (set by the sbatch script)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables the stage's processes get (exported by the sbatch script / the local launcher)."""


def sbatch_script_path(paths: RunPaths, stage: str) -> Path:
    """Where `--dry-run` writes a stage's sbatch script (the one place that names it)."""
    return paths.sbatch_script(stage)


def submitit_folder(paths: RunPaths) -> Path:
    """submitit's pickles and results for the run's jobs (next to the prepared scripts)."""
    return paths.submitit_dir


def job_name(config: ArlConfig, stage: str) -> str:
    """`arl-<experiment>-<trial>-<stage>`: readable in `squeue`; never used to find or cancel jobs."""
    return f"arl-{config.experiment_name}-{config.trial_name}-{stage}"


def stage_argv(stage: str, run_dir: Path, *, python: str | None = None) -> list[str]:
    """`python -m pipeline.cli stage <name> --run-dir D` with this interpreter (the venv on a shared FS)."""
    return [python or sys.executable, "-m", "pipeline.cli", "stage", stage, "--run-dir", str(run_dir)]


def uses_torchrun(stage: str, resources: StageResources) -> bool:
    return stage == "train" and (resources.gpus_per_node > 1 or resources.nodes > 1)


def torchrun_command(resources: StageResources, run_dir: Path, *, python: str | None = None) -> str:
    """One node's torchrun line. `$MASTER_ADDR`, `$MASTER_PORT` and `$SLURM_JOB_ID` expand on the node."""
    python = python or sys.executable
    procs = max(resources.gpus_per_node, 1)
    stage = shlex.join(stage_argv("train", run_dir, python=python)[2:])  # from `pipeline.cli` on
    return (
        f"exec {shlex.quote(python)} -m torch.distributed.run --nnodes={resources.nodes} "
        f'--nproc-per-node={procs} --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" '
        f'--rdzv-id="$SLURM_JOB_ID" -m {stage}'
    )


def stage_env(config: ArlConfig) -> dict[str, str]:
    """Variables every stage gets: the interface gloo and NCCL use between nodes, when one is configured."""
    ifname = config.cluster.network_interface
    return {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname} if ifname else {}


def plan_stage(config: ArlConfig, stage: str, run_dir: Path, *, python: str | None = None) -> StagePlan:
    resources: StageResources = getattr(config.cluster, stage)
    setup = [*config.cluster.setup, *resources.setup]
    env = stage_env(config)
    if uses_torchrun(stage, resources):
        argv = ["bash", "-c", torchrun_command(resources, run_dir, python=python)]
        return StagePlan(stage, argv, resources, setup, torchrun=True, env=env)
    return StagePlan(stage, stage_argv(stage, run_dir, python=python), resources, setup, env=env)


def plan_run(config: ArlConfig, run_dir: Path, *, python: str | None = None) -> list[StagePlan]:
    return [plan_stage(config, stage, run_dir, python=python) for stage in stages_for(config)]


def sbatch_directives(resources: StageResources) -> list[str]:
    """The resource options of one stage job, as `--key=value` (each becomes an `#SBATCH` line)."""
    out = [
        f"--nodes={resources.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={resources.cpus_per_task}",
        f"--time={resources.time_min}",
    ]
    optional = {
        "partition": resources.partition,
        "account": resources.account,
        "qos": resources.qos,
        "constraint": resources.constraint,
        "nodelist": resources.nodelist,
        "exclude": resources.exclude,
    }
    out += [f"--{key}={shlex.quote(value)}" for key, value in optional.items() if value]
    if resources.gpus_per_node > 0:
        out.append(f"--gpus-per-node={resources.gpus_per_node}")
    if resources.mem_gb is not None:
        out.append(f"--mem={resources.mem_gb}G")
    if resources.exclusive:
        out.append("--exclusive")
    out += [_extra_line(line) for line in resources.extra_sbatch]
    return out


def _extra_line(line: str) -> str:
    """`extra_sbatch` lines are verbatim options; a leading `#SBATCH` is tolerated, anything else refused."""
    text = line.strip()
    if text.startswith("#SBATCH"):
        text = text[len("#SBATCH") :].strip()
    if not text.startswith("-") or "\n" in text:
        raise ConfigError(f"cluster.*.extra_sbatch entry {line!r} must be one sbatch option such as --reservation=foo")
    return text
