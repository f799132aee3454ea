"""`arl demo [--task tools]`: a complete local run on a tiny model that learns a task (pipeline/demo/tasks.py):
repeat the number it is asked to (the default), or call a calculator tool with the question's numbers (an OpenAI
Agents SDK agent, two model calls an episode).

The demo is an ordinary user of arl: it makes the task's tiny model if absent (1 layer, warm-started on the
task's format only, see pipeline/demo/warm_start.py), then runs `arl launch examples/<task config> --executor
local` as a child process (inference, rollout with an unmodified agent, trainer), watches the run directory for
progress, and at the end draws the reward and exact-correct curves (terminal + PNG; for the tool task also its
tool-use rate and model calls per episode), compares the first and last steps, and prints the `arl inspect`
command for the run. Exact-correct (`agent/exact_correct`, the agent's metric) is the task itself: step 0
measures the model before RL.

It works from any directory after a plain `pip install`: the config, agent and data come with the
package (`pipeline/examples` is the repository's `examples/`, shipped as package data), the agent
and data are passed to the launcher as absolute paths, and everything the demo writes goes under
`--out` (default `./runs`), printed as absolute paths. Progress is a live table on a terminal and
one line per trained step otherwise (a pipe, `tee`, a log file).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml
from rich.live import Live
from rich.table import Table

from pipeline.demo.curves import ascii_curve, comparison_lines, eval_series, pyplot, reward_of, save_png, series
from pipeline.demo.tasks import REPEAT, DemoTask, demo_file_overrides, ensure_tiny_model, yaml_str
from pipeline.errors import ArlError
from pipeline.launch.rundir import resume_command
from pipeline.run.console import people_console
from pipeline.run.paths import RunPaths
from pipeline.run.progress import StepFeed, StepRecord, step_line, step_table
from pipeline.run.sinks import read_jsonl

DEMO_CONFIG, MODEL_NAME = REPEAT.config, REPEAT.model_name
"""The copy task's config and model directory name (benchmarks and tests run the demo's own)."""
EXACT_KEY = "agent/exact_correct"
console = people_console()


def run_demo(
    steps: int | None,
    out: Path,
    max_staleness: int = 1,
    overrides: list[str] | None = None,
    seed: int = 0,
    task: DemoTask = REPEAT,
) -> int:
    """Run `task` under `out` for `steps` steps (None: its config's `num_steps`); returns the launcher's exit status
    (0 = every stage finished). `overrides` (`key.sub=value`) are passed to `arl launch` after the demo's own, so
    they win. `seed` seeds the dataset order, the trainer and the inference server's sampling."""
    if steps is None:
        steps = task.num_steps()
    if steps < 1:
        raise ArlError(f"--steps must be >= 1, got {steps}")
    out = out.expanduser().resolve()
    files = demo_file_overrides(task)
    model_dir = ensure_tiny_model(out / task.model_name, task)
    trial = datetime.now().strftime("demo-%Y%m%d-%H%M%S") + (f"-seed{seed}" if seed else "")
    experiment = str(yaml.safe_load(task.config.read_text())["experiment_name"])
    paths = RunPaths.from_config(out, experiment, trial)
    overrides = [
        f"fileroot={yaml_str(str(out))}",
        f"trial_name={trial}",
        f"num_steps={steps}",
        f"model.path={yaml_str(str(model_dir))}",
        *files,
        f"rollout.max_staleness={max_staleness}",
        *seed_overrides(seed),
        *(overrides or []),
    ]
    console.print(
        f"[bold]arl demo[/]: {steps} steps (0-{steps - 1}; step k is trained into weight version k+1), "
        f"seed {seed}: {task.goal}"
    )
    console.print(f"run dir: {paths.root}", markup=False, highlight=False)
    started = time.monotonic()
    code = _launch_and_watch(task.config, overrides, paths, steps)
    elapsed = time.monotonic() - started
    summarize(paths, elapsed, task)
    if code == 130:  # Ctrl-C or `arl stop`: a deliberate stop, not a failure
        console.print(
            f"the run was stopped; continue it with: {resume_command(paths, 'local')}", markup=False, highlight=False
        )
    elif code != 0:
        console.print(f"[red]the run failed (exit {code}); logs under {paths.logs}[/]")
    return code


def seed_overrides(seed: int) -> list[str]:
    """The demo's seeds: dataset order, trainer RNGs, and the inference server's sampling."""
    return [f"rollout.dataset.seed={seed}", f"trainer.seed={seed}", f"inference.extra_args=[--seed, '{seed}']"]


def _launch_and_watch(config: Path, overrides: list[str], paths: RunPaths, steps: int) -> int:
    """Run the launcher (in the user's directory, so their relative overrides mean what they say) and show
    progress until it exits."""
    cmd = [sys.executable, "-m", "pipeline.cli", "launch", str(config), *overrides, "--executor", "local"]
    log = paths.root.parent / f"{paths.root.name}.launcher.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        child = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=Path.cwd())
        try:
            if console.is_terminal:
                _watch_table(child, paths, steps)
            else:
                _watch_lines(child, paths, log)
        except KeyboardInterrupt:
            # The launcher stops every stage on SIGINT; wait so no process outlives the demo.
            child.send_signal(signal.SIGINT)
            child.wait(timeout=60)
            raise
    if child.returncode != 0:
        console.print(f"launcher output: {log}", markup=False, highlight=False)
    return child.returncode


def _watch_table(child: subprocess.Popen[bytes], paths: RunPaths, steps: int) -> None:
    """On a terminal: a live table of the last steps."""
    feed = StepFeed(paths)
    started = time.monotonic()
    with Live(_progress_table([], steps, 0.0), console=console, refresh_per_second=2) as live:
        while child.poll() is None:
            if feed.poll():
                _preload_plotting()
            live.update(_progress_table(feed.records(), steps, time.monotonic() - started))
            _wait(child, 1.0)
        feed.poll(final=True)
        live.update(_progress_table(feed.records(), steps, time.monotonic() - started))


def _watch_lines(child: subprocess.Popen[bytes], paths: RunPaths, log: Path) -> None:
    """Not on a terminal (a pipe, `tee`, a log file): one line per trained step, as it is trained."""
    console.print(f"launcher output: {log}", markup=False, highlight=False)
    feed = StepFeed(paths)
    started = time.monotonic()
    while True:
        running = child.poll() is None
        records = feed.poll(final=not running)
        if records:
            _preload_plotting()
        for record in records:
            console.print(f"{step_line(record)}   [{time.monotonic() - started:.0f}s]", markup=False, highlight=False)
        if not running:
            return
        _wait(child, 1.0)


_plotting: threading.Thread | None = None


def _preload_plotting() -> None:
    """Import matplotlib in the background once the run is stepping: `save_png` at the end then skips its 0.4 s
    import, which came after the run, on the demo's wall time (started only then, not at start-up, where the
    stages' own imports compete for the cores)."""
    global _plotting
    if _plotting is None:
        _plotting = threading.Thread(target=pyplot, name="preload-matplotlib", daemon=True)
        _plotting.start()


def _wait(child: subprocess.Popen[bytes], seconds: float) -> None:
    """Up to `seconds`, returning as soon as the launcher exits (a plain sleep held the demo's end up to 1 s)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=seconds)


def _progress_table(records: list[StepRecord], steps: int, elapsed: float) -> Table:
    table = step_table(records[-8:], console)
    table.title = f"arl demo: steps 0-{steps - 1}, {elapsed:.0f}s elapsed" + ("" if records else ", starting")
    return table


def summarize(paths: RunPaths, elapsed: float, task: DemoTask = REPEAT) -> None:
    """Curves in the terminal and as a PNG, the first-vs-last comparison of reward and exact-correct, the
    inspect hint."""
    records = read_jsonl(paths.rollout_metrics)
    rewards = [(int(r["step"]), reward) for r in records if (reward := reward_of(r)) is not None]
    if not rewards:
        console.print("no rollout metrics were written")
        return
    exact = series(records, EXACT_KEY)
    extra = [(spec, series(records, spec.key)) for spec in task.series]
    console.print(ascii_curve(rewards), markup=False, highlight=False)
    for title, points in [("exact-correct per step", exact), *((f"{s.label} per step", p) for s, p in extra)]:
        if points:
            console.print(ascii_curve(points, title=title), markup=False, highlight=False)
    for line in comparison_lines(rewards, exact, elapsed):
        console.print(line)
    evaluations = eval_series(paths)
    for name, points in evaluations.items():
        console.print(
            f"held-out evaluation {name}: " + "   ".join(f"version {v}: {x:.3f}" for v, x in points),
            markup=False,
            highlight=False,
        )
    title = "arl demo" if task is REPEAT else f"arl demo --task {task.name}"
    png = save_png(rewards, paths.reward_curve, exact=exact, evaluations=evaluations, extra=extra, title=title)
    console.print(f"reward curve: {png}", markup=False, highlight=False)
    console.print("inspect the trajectories:")
    console.print(f"  arl inspect {paths.root} --step {rewards[-1][0]} --decode", markup=False, highlight=False)
