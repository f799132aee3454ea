"""The `arl` command line. Each command imports its heavy modules inside the function so that
`arl --help` stays instant; errors meant for people (`ArlError`) print one line and exit 2."""

from __future__ import annotations

import functools
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar

import typer

from pipeline.errors import ArlError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="arl: RL for LLMs on what unmodified agents do.")
F = TypeVar("F", bound=Callable[..., Any])


def _friendly(func: F) -> F:
    """Turn ArlError (and a path that is missing or already there) into `error: ...` and exit code 2,
    without a traceback; the exit codes are listed in docs/cli.md."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            code = func(*args, **kwargs)
        except (ArlError, FileNotFoundError, FileExistsError) as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.secho("interrupted", err=True)
            raise typer.Exit(130) from None
        if isinstance(code, int) and code != 0:
            raise typer.Exit(code)
        return None

    return wrapper  # type: ignore[return-value]


class Executor(StrEnum):
    slurm = "slurm"
    local = "local"


class StageName(StrEnum):
    inference = "inference"
    rollout = "rollout"
    proxy = "proxy"
    train = "train"


class Format(StrEnum):
    table = "table"
    json = "json"
    html = "html"


class EvalFormat(StrEnum):
    """table or json: `arl eval` and `arl diff`."""

    table = "table"
    json = "json"


@app.command()
@_friendly
def launch(
    config: Path = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help="key.sub=value overrides."),
    executor: Executor = typer.Option(Executor.slurm, help="Submit to Slurm, or run the stages as local processes."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the sbatch scripts (written under --out only)."),
    out: Path | None = typer.Option(None, "--out", help="Where --dry-run writes (default: ./arl-dry-run/...)."),
    prepare: bool = typer.Option(False, "--prepare", help="Create the run dir and its sbatch scripts; submit nothing."),
    resume: bool = typer.Option(False, "--resume", help="Continue an existing run from its last complete step."),
    clean: bool = typer.Option(False, "--clean", help="Delete an existing run dir first."),
) -> int:
    """Check everything, create the run dir and start every stage (Slurm jobs via submitit, or local processes)."""
    from pipeline.launch.launcher import launch as do_launch

    return do_launch(
        config,
        overrides or [],
        executor=executor.value,
        dry_run=dry_run,
        prepare=prepare,
        out=out,
        resume=resume,
        clean=clean,
    )


@app.command()
@_friendly
def check(
    config: Path = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help="key.sub=value overrides."),
    executor: Executor = typer.Option(Executor.slurm, help="Check for a Slurm launch, or for local processes."),
) -> int:
    """Check a config before launching: model, chat template, agent, dataset, engine, Slurm resources, fileroot."""
    from pipeline.launch.check import check_command

    return check_command(config, overrides or [], executor=executor.value)


@app.command()
@_friendly
def stage(
    name: StageName = typer.Argument(..., help="Which stage to run."),
    run_dir: Path = typer.Option(..., "--run-dir", help="The run directory (holds config.yaml)."),
    step: int | None = typer.Option(None, "--step", help="Redo exactly this one step, then exit."),
) -> int:
    """Run one stage in this process (what each Slurm job runs)."""
    from pipeline.run.jobs import record_this_slurm_job
    from pipeline.run.paths import RunPaths

    record_this_slurm_job(RunPaths(run_dir), name.value)
    from stages import inference, proxy, rollout, train  # each imports its heavy modules inside main()

    mains = {"inference": inference.main, "rollout": rollout.main, "proxy": proxy.main, "train": train.main}
    return int(mains[name.value](run_dir=run_dir, step=step) or 0)


@app.command()
@_friendly
def status(run_dir: Path = typer.Argument(..., help="The run directory.")) -> int:
    """Jobs and their state, current step and weight version, recent rewards."""
    from pipeline.launch.status import show_status

    return show_status(run_dir)


@app.command()
@_friendly
def stop(run_dir: Path = typer.Argument(..., help="The run directory.")) -> int:
    """Cancel the run's jobs (by Slurm job id or local pid, never by name)."""
    from pipeline.launch.status import stop_run

    return stop_run(run_dir)


@app.command()
@_friendly
def inspect(
    path: Path = typer.Argument(..., help="A part file, a step dir or a run dir."),
    step: int | None = typer.Option(None, "--step", help="Only this step (for a run dir)."),
    decode: bool = typer.Option(False, "--decode", help="Render every turn with the shard's tokenizer."),
    fmt: Format = typer.Option(Format.table, "--format", help="table (terminal), json (scripts) or html (one page)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="html: a directory, or FILE.html for one step."),
    limit: int | None = typer.Option(None, "--limit", help="Most samples listed: 50, or 500 per html page."),
    task: str | None = typer.Option(None, "--task", help="Only the samples of this task (rollout.tasks)."),
    mismatch: Path | None = typer.Option(None, "--mismatch", help="html: colour tokens by an arl replay Parquet."),
) -> int:
    """Offline view of trajectory shards: samples, decoded turns, masks, reward and length statistics."""
    from pipeline.analysis.inspect import inspect_path

    return inspect_path(
        path, step=step, decode=decode, fmt=fmt.value, output=output, limit=limit, task=task, mismatch=mismatch
    )


class QueryFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


@app.command()
@_friendly
def query(
    args: list[str] = typer.Argument(..., metavar="RUN_DIR... SQL", help="Run dirs, then the SQL (- reads stdin)."),
    sql_file: Path | None = typer.Option(None, "--file", "-f", help="Read the SQL from FILE (- reads stdin)."),
    fmt: QueryFormat = typer.Option(QueryFormat.table, "--format", help="table, csv, json (an array) or parquet."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the result to FILE instead of stdout."),
    limit: int | None = typer.Option(None, "--limit", help="At most N rows (a table shows 100 unless given)."),
    schema: bool = typer.Option(False, "--schema", help="List the views and their columns; every argument is a run."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Trust the manifests without hashing the parts."),
) -> int:
    """SQL over runs (DuckDB): views samples, tokens and steps over every complete step; docs/inspect.md."""
    from pipeline.analysis.query import query_command

    return query_command(
        args, sql_file=sql_file, fmt=fmt.value, output=output, limit=limit, schema=schema, verify=not no_verify
    )


@app.command()
@_friendly
def diff(
    run_a: Path = typer.Argument(..., help="The first run dir (A)."),
    run_b: Path = typer.Argument(..., help="The second run dir (B)."),
    fmt: EvalFormat = typer.Option(EvalFormat.table, "--format", help="table (terminal) or json (scripts)."),
    plot: Path | None = typer.Option(None, "--plot", help="Where the PNG goes (default: ./arl-diff-<A>-vs-<B>.png)."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Write no PNG."),
    window: int = typer.Option(10, "--window", help="Steps per window when judging divergence."),
    sigmas: float = typer.Option(3.0, "--sigmas", help="Standard errors a window's difference must exceed."),
    consecutive: int = typer.Option(10, "--consecutive", help="Windows in a row beyond it before a curve diverged."),
) -> int:
    """Two runs side by side: config differences, per-step curves, the first step they diverge beyond noise."""
    from pipeline.analysis.diff import diff_runs
    from pipeline.analysis.divergence import NoiseRule

    rule = NoiseRule(window=window, sigmas=sigmas, consecutive=consecutive)
    return diff_runs(run_a, run_b, fmt=fmt.value, plot=plot, no_plot=no_plot, rule=rule)


@app.command("eval")
@_friendly
def eval_cmd(
    run_dir: Path = typer.Argument(..., help="The run directory."),
    step: int | None = typer.Option(None, "--step", help="Evaluate weight version K (0 = the initial model)."),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="Evaluate this model dir (step_<version>)."),
    set_name: str | None = typer.Option(None, "--set", help="Only the eval set of this name."),
    fmt: EvalFormat = typer.Option(EvalFormat.table, "--format", help="table (terminal) or json (scripts)."),
) -> int:
    """Evaluate one checkpoint on the run's eval sets with an engine of its own (default: the newest checkpoint)."""
    from pipeline.eval.offline import eval_command

    return eval_command(run_dir, step=step, checkpoint=checkpoint, set_name=set_name, fmt=fmt.value)


@app.command("export-merged")
@_friendly
def export_merged_cmd(
    run_dir: Path = typer.Argument(..., help="The run directory (a run with trainer.lora)."),
    out: Path = typer.Argument(..., help="Where the merged Hugging Face model goes (must not exist)."),
    step: int = typer.Option(..., "--step", help="The checkpoint's weight version K."),
) -> int:
    """Merge the LoRA adapter of checkpoint K into its base and write a plain Hugging Face model."""
    from pipeline.trainer.lora import export_run_checkpoint

    print(export_run_checkpoint(run_dir, step, out))
    return 0


@app.command()
@_friendly
def replay(
    run_dir: Path = typer.Argument(..., help="The run directory."),
    step: int = typer.Option(..., "--step", help="The trajectory step whose sampled tokens are scored again."),
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="Score under this model (default: each token's own version)."
    ),
    device: str = typer.Option("cpu", "--device", help="Where the model runs: cpu, cuda or auto."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Per-token Parquet (default RUN/replay/step_K.parquet)."
    ),
    fmt: EvalFormat = typer.Option(EvalFormat.table, "--format", help="table (terminal) or json (scripts)."),
    worst: int = typer.Option(10, "--worst", help="How many of the largest-|delta| tokens to show."),
) -> int:
    """Score a step's sampled tokens again with the trainer's forward path: the mismatch with the engine's log-probs."""
    from pipeline.analysis.replay import replay_command

    return replay_command(
        run_dir, step, checkpoint=checkpoint, device=device, output=output, fmt=fmt.value, worst=worst
    )


@app.command()
@_friendly
def demo(
    overrides: list[str] = typer.Argument(None, help="key.sub=value overrides of examples/demo.yaml."),
    steps: int | None = typer.Option(None, "--steps", help="Training steps (default: the demo config's num_steps)."),
    out: Path = typer.Option(Path("runs"), "--out", "--workdir", help="Where the tiny model and the run dir go."),
    max_staleness: int = typer.Option(1, "--max-staleness", help="0 = synchronous, 1 = overlap rollout and training."),
    seed: int = typer.Option(0, "--seed", help="Seed of the dataset order, the trainer and the server's sampling."),
    task: str = typer.Option(
        "repeat", "--task", help="repeat (a one-turn copy task) or tools (an Agents SDK agent with a calculator tool)."
    ),
) -> int:
    """A complete local run on a tiny model (CPU): inference, rollout with an OpenAI-SDK agent, training."""
    from pipeline.demo.demo_run import run_demo
    from pipeline.demo.tasks import task_named

    chosen = task_named(task)
    return run_demo(
        steps=steps, out=out, max_staleness=max_staleness, overrides=overrides or [], seed=seed, task=chosen
    )


@app.command()
@_friendly
def doctor(
    overrides: list[str] = typer.Argument(None, help="key.sub=value overrides of the doctor's run config."),
    gpu: bool = typer.Option(False, "--gpu", help="GPU acceptance run: SGLang/vLLM server, bf16, NCCL publication."),
    backend: str | None = typer.Option(None, "--backend", help="sglang (default with --gpu), vllm, or hf."),
    model: str | None = typer.Option(None, "--model", help="HF model dir or cached hub name (default: tiny model)."),
    steps: int = typer.Option(3, "--steps", help="Training steps of the run."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Where the run dir goes (default: a temp dir)."),
) -> int:
    """A tiny real run (server, rollout, trainer, publication), then a pass/fail table of checks."""
    from pipeline.demo.doctor import DoctorOptions, run_doctor

    return run_doctor(
        DoctorOptions(gpu=gpu, backend=backend, model=model, steps=steps, workdir=workdir, overrides=overrides or [])
    )


@app.command("make-tiny-model")
@_friendly
def make_tiny_model_cmd(
    out_dir: Path = typer.Argument(..., help="Directory to create."),
    template: str = typer.Option(
        None, help="Chat template: qwen (Qwen2.5's), qwen3 (Qwen3's) or llama3 (default: qwen3 for the qwen3 archs)."
    ),
    arch: str = typer.Option("qwen2", help="Architecture: qwen2, qwen3 or qwen3_moe (4 experts, top 2)."),
    layers: int = typer.Option(2, help="Transformer layers."),
    hidden: int = typer.Option(128, help="Hidden size."),
    seed: int = typer.Option(0, help="Seed for weights and tokenizer training."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing directory."),
    warm_start: Path | None = typer.Option(
        None,
        "--warm-start",
        help="Then train it briefly on this chat corpus "
        "(JSONL rows {messages, reply}, e.g. examples/data/demo_format.jsonl).",
    ),
    warm_start_steps: int = typer.Option(120, "--warm-start-steps", help="Supervised steps of --warm-start."),
) -> None:
    """Make an offline, seeded, tiny Qwen2/Qwen3/Qwen3-MoE model + tokenizer (for tests and the demo)."""
    from pipeline.demo.tiny_model import ARCHS, make_tiny_model

    chosen = template or ("qwen3" if arch.startswith("qwen3") else "qwen")
    styles: dict[str, Literal["qwen", "llama3", "qwen3"]] = {"qwen": "qwen", "llama3": "llama3", "qwen3": "qwen3"}
    if chosen not in styles:
        raise ArlError(f"--template must be qwen, qwen3 or llama3, got {chosen!r}")
    kinds: dict[str, Literal["qwen2", "qwen3", "qwen3_moe"]] = {a: a for a in ARCHS}
    if arch not in kinds:
        raise ArlError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    path = make_tiny_model(
        out_dir,
        template=styles[chosen],
        num_layers=layers,
        hidden_size=hidden,
        seed=seed,
        overwrite=overwrite,
        arch=kinds[arch],
    )
    typer.echo(f"tiny model written to {path}")
    if warm_start is not None:
        from pipeline.demo.warm_start import warm_start as run_warm_start

        done = run_warm_start(path, warm_start, steps=warm_start_steps, seed=seed)
        typer.echo(
            f"warm start: {done.steps} supervised steps on {done.corpus} ({done.rows} rows), "
            f"loss {done.first_loss:.2f} -> {done.last_loss:.2f}"
        )


@app.command()
@_friendly
def config(
    config_path: Path | None = typer.Argument(None, help="YAML config (omit for the defaults)."),
    overrides: list[str] = typer.Argument(None, help="key.sub=value overrides."),
) -> None:
    """Print the resolved config (validates it: unknown keys and bad values are errors)."""
    from pipeline.run.config import dump_config, load_config

    typer.echo(dump_config(load_config(config_path, overrides or [])))


@app.command()
@_friendly
def bench(
    only: list[str] = typer.Option(None, "--only", help="Run only these benchmarks (file stems)."),
    timeout_min: float = typer.Option(
        60.0, "--timeout-min", min=0.1, help="Minutes each benchmark may run before it counts as failed."
    ),
) -> int:
    """Run every benchmark under benchmarks/ and write benchmarks/RESULTS.md."""
    from pipeline.analysis.bench import run_benchmarks

    return run_benchmarks(only or [], timeout_s=60.0 * timeout_min)


def main() -> None:  # pragma: no cover - console entry (`arl`, and `python -m pipeline.cli` in every stage)
    from pipeline.run.logs import freeze_for_exit

    try:
        app(prog_name="arl")
    finally:
        freeze_for_exit()


if __name__ == "__main__":  # pragma: no cover
    main()
