"""`arl launch`: create (or resume) the run dir, then start every stage as a Slurm job or a local process.

The stages coordinate only through the run dir, so they are submitted independently and in any
order; each gets the next attempt number of its own, and `jobs.json` records every attempt with
its log. On Slurm the launcher returns once the jobs are queued (watch them with `arl status`);
locally it supervises the processes until the trainer is done.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rich.console import Console

from pipeline.errors import ArlError, SchemaError, WaitTimeout
from pipeline.launch.check import require, warn_if_python_not_shared
from pipeline.launch.plan import StagePlan, plan_run, sbatch_script_path
from pipeline.launch.rundir import create_run_dir, refuse_if_running, remove_run_dir, resolve_run
from pipeline.launch.sbatch import render_sbatch
from pipeline.run.config import dump_config
from pipeline.run.handoff import write_text_atomic
from pipeline.run.job_state import JobState, record_states
from pipeline.run.jobs import JobRecord, add_record, latest, next_attempt, read_jobs, update_record
from pipeline.run.paths import RunPaths
from pipeline.run.weight_version import published_version
from schemas.config import ArlConfig

EXECUTORS = ("slurm", "local")


def launch(
    config_path: str | Path,
    overrides: list[str],
    *,
    executor: str = "slurm",
    dry_run: bool = False,
    prepare: bool = False,
    out: Path | None = None,
    resume: bool = False,
    clean: bool = False,
) -> int:
    """`arl launch` (docs/cli.md). Exit status: 0 submitted / finished, 1 a stage failed, 130 interrupted.

    Everything is checked (`pipeline.launch.check.require`) before anything is written or submitted. `dry_run`
    writes the scripts under `out` only; `prepare` creates the run dir and its scripts for plain sbatch.
    """
    if executor not in EXECUTORS:
        raise ArlError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if dry_run and prepare:
        raise ArlError(
            "pass --dry-run (print the scripts, write nothing under fileroot) or --prepare (create the "
            "run dir and its scripts for plain sbatch), not both"
        )
    console = Console(soft_wrap=True)
    config, paths = resolve_run(Path(config_path), overrides, resume=resume, clean=clean)
    # Relative paths in the config (model, data) mean the same to every job: they all start in `workdir`.
    workdir = Path(config.cluster.workdir if config.cluster.workdir and executor == "slurm" else os.getcwd())
    require(config, executor=executor, submit=not (dry_run or prepare), workdir=workdir)
    if executor == "slurm":
        warn_if_python_not_shared(config, console)
    plans = plan_run(config, paths.root, python=config.cluster.python if executor == "slurm" else None)
    if dry_run:
        attempts = {plan.stage: next_attempt(paths, plan.stage) for plan in plans}
        target = (out or Path("arl-dry-run") / f"{config.experiment_name}-{config.trial_name}").absolute()
        return write_dry_run(plans, config, paths, attempts, workdir=workdir, out=target, console=console)
    if resume and not prepare:
        plans = _skip_live_stages(plans, paths, executor, console)
        if not plans:
            console.print("every stage is still running: nothing to relaunch (`arl status` shows them)")
            return 0
    if resume and not prepare and (done := finished_version(paths)) >= config.num_steps:
        console.print(
            f"the run is already complete (weight version {done} >= num_steps={config.num_steps}); "
            "pass num_steps=<more> with --resume to train further"
        )
        return 0
    fresh = not paths.root.exists() or clean
    create_run_dir(config, paths, clean=clean)
    attempts = {plan.stage: next_attempt(paths, plan.stage) for plan in plans}
    console.print(f"run dir: {paths.root}  (config frozen in {paths.config})")
    if prepare:
        return write_prepared(plans, config, paths, attempts, workdir=workdir, console=console)
    if executor == "local":
        from pipeline.launch.local import run_local

        console.print(f"starting {len(plans)} local stages (Ctrl-C stops them all):")
        return run_local(plans, paths, attempts, workdir=workdir, console=console)
    submit_all(plans, config, paths, attempts, workdir=workdir, console=console, fresh=fresh)
    return 0


def submit_all(
    plans: list[StagePlan],
    config: ArlConfig,
    paths: RunPaths,
    attempts: dict[str, int],
    *,
    workdir: Path,
    console: Console,
    fresh: bool = False,
) -> list[JobRecord]:
    """Submit every stage job, recording each in `jobs.json` as soon as Slurm accepted it.

    When one is refused, the jobs this launch already submitted are cancelled, and a run dir this launch
    created is removed: nothing is left behind, so the same command (or another executor) can be retried.
    """
    from pipeline.launch.slurm import submit_stage

    records: list[JobRecord] = []
    for plan in plans:
        try:
            record = submit_stage(plan, config, paths, attempt=attempts[plan.stage], workdir=workdir)
        except ArlError as exc:
            raise ArlError(f"{exc}. {_undo_submission(records, paths, fresh=fresh)}") from None
        add_record(paths, record)
        records.append(record)
    console.print(f"submitted {len(records)} Slurm jobs:")
    for r in records:
        console.print(f"  {r.stage:<9} job {r.job_id:<8} attempt {r.attempt}   tail -F {r.log}")
    console.print(f"watch: arl status {paths.root}    stop: arl stop {paths.root}")
    return records


def _undo_submission(records: list[JobRecord], paths: RunPaths, *, fresh: bool) -> str:
    """Cancel what this launch submitted; remove the run dir it created. Returns what was done, for the error."""
    from pipeline.launch.slurm import scancel

    done = []
    if records:
        for record in records:
            record.stopped = True
            update_record(paths, record)
        scancel([r.job_id for r in records if r.job_id])
        _states_once_settled(records, deadline_s=60.0)  # their processes end before the dir goes
        done.append("cancelled " + ", ".join(f"{r.stage} (job {r.job_id})" for r in records))
    if fresh:
        remove_run_dir(paths.root)
        done.append(f"removed the run dir {paths.root} this launch created")
    else:
        done.append(f"kept the run dir {paths.root}: it existed before")
    return "Nothing is left running: " + "; ".join(done)


def write_dry_run(
    plans: list[StagePlan],
    config: ArlConfig,
    paths: RunPaths,
    attempts: dict[str, int],
    *,
    workdir: Path,
    out: Path,
    console: Console,
) -> int:
    """Write each stage's sbatch script and the resolved config under `out`, print them; nothing else is written."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "config.yaml", dump_config(config))
    scripts = []
    for plan in plans:
        path = out / f"{plan.stage}.sbatch"
        write_text_atomic(
            path, render_sbatch(plan, config, paths, attempt=attempts[plan.stage], workdir=workdir, script_path=path)
        )
        scripts.append(path)
        console.print(f"# ---- {path}", markup=False, highlight=False)  # a rule would cut a long path short
        console.print(path.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print("# ----", markup=False, highlight=False)
    console.print(
        f"dry run: nothing submitted, nothing written under fileroot; the scripts and the resolved config are in {out}"
    )
    console.print(
        f"to submit by hand: the same arl launch command with --prepare instead of --dry-run creates the "
        f"run dir {paths.root} and writes these scripts into it; then sbatch them in any order",
        markup=False,
        highlight=False,
    )
    return 0


def write_prepared(
    plans: list[StagePlan],
    config: ArlConfig,
    paths: RunPaths,
    attempts: dict[str, int],
    *,
    workdir: Path,
    console: Console,
) -> int:
    """`--prepare`: the run dir exists; write one sbatch script per stage into it and say how to submit them."""
    scripts = []
    for plan in plans:
        path = sbatch_script_path(paths, plan.stage)
        paths.stage_logs(plan.stage).mkdir(parents=True, exist_ok=True)  # sbatch does not create --output's dir
        write_text_atomic(path, render_sbatch(plan, config, paths, attempt=attempts[plan.stage], workdir=workdir))
        path.chmod(0o755)
        scripts.append(path)
    console.print("prepared: nothing submitted. Submit the stages in any order with plain sbatch:")
    for path in scripts:
        console.print(f"  sbatch {path}", markup=False, highlight=False)
    return 0


def finished_version(paths: RunPaths) -> int:
    """The newest weight version the trainer completed (checkpoint marker or published version)."""
    try:
        published = published_version(paths)
    except SchemaError:
        published = 0  # the checkpoints still say how far the trainer got
    return max([published, *paths.complete_checkpoints()])


def _skip_live_stages(plans: list[StagePlan], paths: RunPaths, executor: str, console: Console) -> list[StagePlan]:
    """On resume, relaunch only the stages whose newest attempt has ended (e.g. a cancelled trainer).

    Live Slurm jobs keep running (the servers keep their warm caches); live local processes
    cannot be adopted by a new supervisor, so a local resume needs them stopped first.
    """
    newest = latest(read_jobs(paths))
    states = _states_once_settled(list(newest.values()))
    live = {stage: r for stage, r in newest.items() if states[(stage, r.attempt)].alive}
    if live and executor == "local":
        refuse_if_running(paths, "--resume --executor local")
    for stage, r in sorted(live.items()):
        console.print(f"  {stage:<9} still running (job {r.job_id}, attempt {r.attempt}): kept")
    return [plan for plan in plans if plan.stage not in live]


def _states_once_settled(records: list[JobRecord], deadline_s: float = 180.0) -> dict[tuple[str, int], JobState]:
    """Record states, after waiting (with a deadline) for jobs Slurm is still tearing down to end.

    A job cancelled a moment ago stays COMPLETING in squeue until its processes are reaped; keeping
    it would leave the stage dead after the resume, relaunching it would run two copies at once.
    """
    start = time.monotonic()
    while True:
        states = record_states(records)
        ending = [f"{stage} (attempt {attempt}): {s.state}" for (stage, attempt), s in states.items() if s.ending]
        if not ending:
            return states
        if time.monotonic() - start > deadline_s:
            raise WaitTimeout(
                f"--resume waited {deadline_s:.0f} s for Slurm to finish ending "
                f"{', '.join(ending)}; check `squeue` and retry"
            )
        time.sleep(2.0)
