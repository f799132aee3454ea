"""Create, resume or clean a run dir, and freeze the resolved config into it.

A run dir is never silently reused: an existing one needs `--resume` (continue it) or `--clean`
(delete it). Resume keeps the frozen config, so a run cannot drift halfway; the config file given
again must agree with it wherever a difference would change the results, and overrides may change
only what is safe to change mid-run (`RESUMABLE`: step count, resources, timeouts, ports).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from pipeline.errors import ArlError
from pipeline.run.config import dump_config, load_config
from pipeline.run.handoff import write_text_atomic
from pipeline.run.job_state import record_states
from pipeline.run.jobs import read_jobs
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig

log = logging.getLogger("arl.launch")

RESUMABLE = (
    "num_steps",
    "cluster",
    "metrics",
    "eval",
    "inference.num_servers",
    "inference.host",
    "inference.port",
    "inference.python",
    "inference.extra_args",
    "inference.mem_fraction",
    "inference.max_batch_size",
    "inference.startup_timeout_s",
    "inference.request_timeout_s",
    "proxy.host",
    "proxy.port",
    "proxy.session_timeout_s",
    "proxy.max_sessions",
    "rollout.max_concurrency",
    "rollout.subproc_workers",
    "rollout.agent_transport",
    "rollout.run_timeout_s",
    "rollout.wait_timeout_s",
    "trainer.wait_timeout_s",
    "trainer.publish_timeout_s",
    "trainer.keep_checkpoints",
    "trainer.checkpoint_every",
)
"""Config keys (and sub-trees) a resumed run may change: none of them changes what is computed."""


def resume_command(paths: RunPaths, executor: str) -> str:
    """How to continue a stopped run: its frozen config (relative paths in it resolve from the launch directory,
    and the demo's are absolute), `--resume`, and the executor it ran under."""
    return f"arl launch {paths.config} --resume" + (" --executor local" if executor == "local" else "")


def prepare_run_dir(
    config_path: Path, overrides: list[str], *, resume: bool, clean: bool
) -> tuple[ArlConfig, RunPaths]:
    """The config to run with and the (absolute) run dir, created or checked; config.yaml written."""
    config, paths = resolve_run(config_path, overrides, resume=resume, clean=clean)
    create_run_dir(config, paths, clean=clean)
    return config, paths


def resolve_run(config_path: Path, overrides: list[str], *, resume: bool, clean: bool) -> tuple[ArlConfig, RunPaths]:
    """The config to run with and the (absolute) run dir, checked but not touched: nothing is written."""
    if resume and clean:
        raise ArlError("pass either --resume (continue the run) or --clean (delete it and start over), not both")
    config = load_config(config_path, overrides)
    paths = RunPaths(
        Path(os.path.abspath(RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name).root))
    )
    if resume:
        if not paths.root.exists():
            raise ArlError(
                f"--resume: run dir {paths.root} does not exist, so there is nothing to resume; "
                "drop --resume to start a new run"
            )
        config = resumed_config(paths, config_path, overrides)
    elif has_run_data(paths):
        if not clean:
            raise ArlError(
                f"run dir {paths.root} already exists: pass --resume to continue that run, or --clean "
                f"to delete it and start over (or choose another trial_name=...)"
            )
        refuse_if_running(paths, "--clean")
    return config, paths


def create_run_dir(config: ArlConfig, paths: RunPaths, *, clean: bool) -> None:
    """Make the run dir `resolve_run` checked (after `--clean` removed the old one) and freeze the config."""
    if clean and has_run_data(paths):
        remove_run_dir(paths.root)
    paths.root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(paths.config, dump_config(config))


def has_run_data(paths: RunPaths) -> bool:
    """True when the run dir holds more than a dry run leaves (config.yaml, sbatch/, empty log dirs)."""
    if not paths.root.exists():
        return False
    dry_run_only = {paths.config.name, "sbatch"}
    for child in paths.root.iterdir():
        if child == paths.logs and not any(p.is_file() for p in child.rglob("*")):
            continue
        if child.name not in dry_run_only:
            return True
    return False


def resumed_config(paths: RunPaths, config_path: Path, overrides: list[str]) -> ArlConfig:
    """The frozen config, with `overrides` applied where that is safe; refuse a config that disagrees."""
    if not paths.config.exists():
        raise ArlError(
            f"--resume: {paths.root} has no config.yaml, so it is not a run dir arl created; "
            "use --clean to start over there"
        )
    frozen = load_config(paths.config)
    given = load_config(config_path, overrides)
    unsafe = [d for d in differences(frozen, given) if not resumable(d[0])]
    if unsafe:
        raise ArlError(
            f"--resume: {config_path} with these overrides differs from the run's frozen config "
            f"({paths.config}) in ways that change the results: {_describe(unsafe)}. Resume with the "
            "same config and overrides, or start a new trial (trial_name=...), or pass --clean"
        )
    resumed = load_config(paths.config, overrides)  # the frozen config; only the overrides change it
    applied = {key for key, _, _ in differences(frozen, resumed)}
    kept = [key for key, _, _ in differences(frozen, given) if key not in applied]
    if kept:
        log.warning(
            "--resume keeps the frozen values of %s (changed only in the config file); pass key=value "
            "overrides to change them",
            ", ".join(kept),
        )
    return resumed


def resumable(key: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in RESUMABLE)


def differences(old: ArlConfig, new: ArlConfig) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs."""
    flat_old, flat_new = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    keys = sorted(set(flat_old) | set(flat_new))
    return [(k, flat_old.get(k), flat_new.get(k)) for k in keys if flat_old.get(k) != flat_new.get(k)]


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _describe(diffs: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{key}: frozen {old!r}, now {new!r}" for key, old, new in diffs)


def refuse_if_running(paths: RunPaths, action: str) -> None:
    """A run with live jobs must be stopped first, or two trainers would write the same steps."""
    records = [r for attempts in read_jobs(paths).values() for r in attempts]
    states = record_states(records)
    live = [(r, states[(r.stage, r.attempt)]) for r in records if states[(r.stage, r.attempt)].alive]
    if live:
        jobs = ", ".join(f"{r.stage} ({r.job_id or 'pid ' + str(r.pid)}, {s.state})" for r, s in live)
        raise ArlError(
            f"{action}: run {paths.root} still has live jobs: {jobs}. Stop them first with `arl stop {paths.root}`"
        )


def remove_run_dir(root: Path) -> None:
    """Rename the run dir away first, so no job ever sees it half deleted."""
    doomed = root.with_name(f"{root.name}.{uuid.uuid4().hex[:8]}.old.tmp")
    os.replace(root, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
