"""Render a stage's sbatch script from the template in the repo's `slurm/` directory.

The same renderer makes the scripts `--dry-run` writes (their last line runs the stage directly,
so plain `sbatch` works) and the scripts submitit submits (their last line runs submitit's
runner, which calls the same stage command): one template, so the two can never drift apart.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from pipeline.errors import ArlError
from pipeline.launch.plan import StagePlan, job_name, sbatch_directives, sbatch_script_path
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig

TEMPLATE_NAME = "stage.sbatch.j2"


def template_dir() -> Path:
    """`pipeline/slurm`: the repo's `slurm/` directory in a checkout (a link to it), package data in a wheel."""
    return Path(__file__).resolve().parents[1] / "slurm"


def render_sbatch(
    plan: StagePlan,
    config: ArlConfig,
    paths: RunPaths,
    *,
    attempt: int,
    workdir: Path,
    submitit_command: str | None = None,
    script_path: Path | None = None,
) -> str:
    """The sbatch script of `plan`'s stage for `attempt`.

    `submitit_command` (submitit's runner line) replaces the direct stage command when the job is
    submitted through submitit; without it the script runs the stage itself.
    """
    import jinja2

    path = template_dir() / TEMPLATE_NAME
    if not path.exists():
        raise ArlError(
            f"sbatch template {path} is missing: reinstall arl (its wheel ships the template), or in a "
            "checkout restore slurm/ and the pipeline/slurm link to it"
        )
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    template = env.from_string(path.read_text())
    command = submitit_command if submitit_command is not None else shlex.join(plan.argv)
    return template.render(
        stage=plan.stage,
        attempt=attempt,
        run_dir=str(paths.root),
        run_dir_q=shlex.quote(str(paths.root)),
        script_path=str(script_path or sbatch_script_path(paths, plan.stage)),
        job_name=shlex.quote(job_name(config, plan.stage)),
        log=shlex.quote(str(paths.stage_log(plan.stage, attempt))),
        workdir=shlex.quote(str(workdir)),
        directives=sbatch_directives(plan.resources),
        setup=plan.setup,
        torchrun=plan.torchrun,
        env=[(name, shlex.quote(value)) for name, value in sorted(plan.env.items())],
        submitit=submitit_command is not None,
        command=command,
    )
