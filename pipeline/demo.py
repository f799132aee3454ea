"""`arl demo`: a complete local run on a tiny model, showing the reward rise.

The demo is an ordinary user of arl: it makes the tiny model if absent, then runs
`arl launch examples/demo.yaml --executor local` as a child process (inference, rollout with an
unmodified OpenAI-SDK agent, trainer), watches the run directory for progress, and at the end
draws the reward curve (terminal + PNG) and prints the `arl inspect` command for the run.

It works from any directory after a plain `pip install`: the config, agent and data come with the
package (`pipeline/examples` is the repository's `examples/`, shipped as package data), the agent
and data are passed to the launcher as absolute paths, and everything the demo writes goes under
`--out` (default `./runs`), printed as absolute paths. Progress is a live table on a terminal and
one line per trained step otherwise (a pipe, `tee`, a log file).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from rich.live import Live
from rich.table import Table

from pipeline.console import people_console
from pipeline.errors import ArlError
from pipeline.metrics import read_jsonl
from pipeline.paths import RunPaths
from pipeline.run_progress import StepFeed, StepRecord, step_line, step_table

EXAMPLES = (Path(__file__).parent / "examples").resolve()
"""The demo's files: the repository's `examples/` in a checkout, package data in an installed wheel."""
DEMO_CONFIG = EXAMPLES / "demo.yaml"
DEMO_AGENT = EXAMPLES / "demo_agent.py"
DEMO_DATA = EXAMPLES / "data" / "demo.jsonl"
console = people_console()


def demo_file_overrides() -> list[str]:
    """The demo config's agent and dataset as absolute paths, so its run works from any directory."""
    for path in (DEMO_CONFIG, DEMO_AGENT, DEMO_DATA):
        if not path.exists():
            raise ArlError(f"the demo's file {path} is missing from the installed arl package; reinstall arl "
                           "(`pip install --force-reinstall arl`, or `pip install -e .` in a checkout)")  # fmt: skip
    return [
        f"rollout.agent={_yaml_str(f'{DEMO_AGENT}:DemoAgent')}",
        f"rollout.dataset.path={_yaml_str(str(DEMO_DATA))}",
    ]


def run_demo(steps: int, out: Path, max_staleness: int = 1, overrides: list[str] | None = None) -> int:
    """Run the demo under `out`; returns the launcher's exit status (0 = every stage finished).
    `overrides` (`key.sub=value`) are passed to `arl launch` after the demo's own, so they win."""
    if steps < 1:
        raise ArlError(f"--steps must be >= 1, got {steps}")
    out = out.expanduser().resolve()
    files = demo_file_overrides()
    model_dir = ensure_tiny_model(out / "tiny-model")
    trial = datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    paths = RunPaths.from_config(out, "demo", trial)
    overrides = [f"fileroot={_yaml_str(str(out))}", f"trial_name={trial}", f"num_steps={steps}",
                 f"model.path={_yaml_str(str(model_dir))}", *files, f"rollout.max_staleness={max_staleness}",
                 *(overrides or [])]  # fmt: skip
    console.print(f"[bold]arl demo[/]: {steps} steps (0-{steps - 1}; step k is trained into weight version k+1) "
                  f"on a tiny model")  # fmt: skip
    console.print(f"run dir: {paths.root}", markup=False, highlight=False)
    started = time.monotonic()
    code = _launch_and_watch(overrides, paths, steps)
    elapsed = time.monotonic() - started
    summarize(paths, elapsed)
    if code != 0:
        console.print(f"[red]the run failed (exit {code}); logs under {paths.logs}[/]")
    return code


def _yaml_str(value: str) -> str:
    """`value` as an override's right-hand side (parsed as YAML): quoted only where YAML would change it."""
    try:
        if yaml.safe_load(value) == value:
            return value
    except yaml.YAMLError:
        pass
    return json.dumps(value)


def ensure_tiny_model(model_dir: Path) -> Path:
    """Make the tiny model the first time; reuse it afterwards (it is seeded, so always the same)."""
    if (model_dir / "config.json").exists():
        return model_dir
    from pipeline.tiny_model import make_tiny_model

    console.print(f"making the tiny model in {model_dir} ...")
    return make_tiny_model(model_dir)


def _launch_and_watch(overrides: list[str], paths: RunPaths, steps: int) -> int:
    """Run the launcher (in the user's directory, so their relative overrides mean what they say) and show
    progress until it exits."""
    cmd = [sys.executable, "-m", "pipeline.cli", "launch", str(DEMO_CONFIG), *overrides, "--executor", "local"]
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
            feed.poll()
            live.update(_progress_table(feed.records(), steps, time.monotonic() - started))
            time.sleep(1.0)
        feed.poll()
        live.update(_progress_table(feed.records(), steps, time.monotonic() - started))


def _watch_lines(child: subprocess.Popen[bytes], paths: RunPaths, log: Path) -> None:
    """Not on a terminal (a pipe, `tee`, a log file): one line per trained step, as it is trained."""
    console.print(f"launcher output: {log}", markup=False, highlight=False)
    feed = StepFeed(paths)
    started = time.monotonic()
    while True:
        running = child.poll() is None
        for record in feed.poll():
            console.print(f"{step_line(record)}   [{time.monotonic() - started:.0f}s]", markup=False, highlight=False)
        if not running:
            return
        time.sleep(1.0)


def _progress_table(records: list[StepRecord], steps: int, elapsed: float) -> Table:
    table = step_table(records[-8:], console)
    table.title = f"arl demo: steps 0-{steps - 1}, {elapsed:.0f}s elapsed" + ("" if records else ", starting")
    return table


def reward_of(record: dict[str, Any]) -> float | None:
    for key in ("reward_mean", "reward/mean", "reward"):
        if isinstance(record.get(key), int | float):
            return float(record[key])
    return None


def summarize(paths: RunPaths, elapsed: float) -> None:
    """Reward curve in the terminal and as a PNG, the first-vs-last comparison, the inspect hint."""
    records = read_jsonl(paths.rollout_metrics)
    rewards = [(int(r["step"]), reward) for r in records if (reward := reward_of(r)) is not None]
    if not rewards:
        console.print("no rollout metrics were written")
        return
    console.print(ascii_curve(rewards), markup=False, highlight=False)
    k = max(1, len(rewards) // 5)
    first, last = rewards[:k], rewards[-k:]
    console.print(f"mean reward, {_span(first)}: {_mean(first):.3f}   {_span(last)}: {_mean(last):.3f}   "
                  f"change: [bold]{_mean(last) - _mean(first):+.3f}[/] in {elapsed:.0f}s")  # fmt: skip
    png = save_png(rewards, paths.reward_curve)
    console.print(f"reward curve: {png}", markup=False, highlight=False)
    console.print("inspect the trajectories:")
    console.print(f"  arl inspect {paths.root} --step {rewards[-1][0]} --decode", markup=False, highlight=False)


def _span(rewards: list[tuple[int, float]]) -> str:
    lo, hi = rewards[0][0], rewards[-1][0]
    return f"step {lo}" if lo == hi else f"steps {lo}-{hi}"


def _mean(rewards: list[tuple[int, float]]) -> float:
    return sum(r for _, r in rewards) / len(rewards)


def ascii_curve(rewards: list[tuple[int, float]], height: int = 8) -> str:
    """A small bar chart of one column per step (values in [0, 1] are typical; scaled to the range), its
    axis labelled with the first and last step numbers."""
    values = [r for _, r in rewards]
    lo, hi = min(0.0, *values), max(1e-9, *values)
    rows = []
    for level in range(height, 0, -1):
        threshold = lo + (hi - lo) * (level - 0.5) / height
        label = f"{lo + (hi - lo) * level / height:5.2f} |" if level in (height, 1) else "      |"
        rows.append(label + "".join("█" if v >= threshold else " " for v in values))
    rows.append("      +" + "-" * len(values) + " step")
    first, last = str(rewards[0][0]), str(rewards[-1][0])
    rows.append(" " * 7 + first + last.rjust(len(values) - len(first)) if len(values) > len(first) + len(last)
                else " " * 7 + first)  # fmt: skip
    return "reward per step\n" + "\n".join(rows)


def save_png(rewards: list[tuple[int, float]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in rewards], [r for _, r in rewards], marker="o", markersize=3)
    ax.set_xlabel("step (step k is trained into weight version k+1)")
    ax.set_ylabel("mean reward")
    ax.set_title("arl demo: reward per step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path
