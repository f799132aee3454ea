"""`arl demo`: a complete local run on a tiny model, showing the reward rise.

The demo is an ordinary user of arl: it makes the tiny model if absent, then runs
`arl launch examples/demo.yaml --executor local` as a child process (inference, rollout with an
unmodified OpenAI-SDK agent, trainer), watches the run directory for progress, and at the end
draws the reward curve (terminal + PNG) and prints the `arl inspect` command for the run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from pipeline.errors import ArlError
from pipeline.metrics import read_jsonl
from pipeline.paths import RunPaths

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO_ROOT / "examples" / "demo.yaml"
console = Console()


def run_demo(steps: int, workdir: Path, max_staleness: int = 1, overrides: list[str] | None = None) -> int:
    """Run the demo; returns the launcher's exit status (0 = every stage finished). `overrides`
    (`key.sub=value`) are passed to `arl launch` after the demo's own, so they win."""
    if not DEMO_CONFIG.exists():
        raise ArlError(f"demo config not found at {DEMO_CONFIG}: run `arl demo` from a source checkout")
    model_dir = ensure_tiny_model(workdir / "tiny-model")
    trial = datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    paths = RunPaths.from_config(workdir, "demo", trial)
    overrides = [f"fileroot={workdir}", f"trial_name={trial}", f"num_steps={steps}", f"model.path={model_dir}",
                 f"rollout.max_staleness={max_staleness}", *(overrides or [])]  # fmt: skip
    console.print(f"[bold]arl demo[/]: {steps} steps on a tiny model, run dir [cyan]{paths.root}[/]")
    started = time.monotonic()
    code = _launch_and_watch(overrides, paths, steps)
    elapsed = time.monotonic() - started
    summarize(paths, elapsed)
    if code != 0:
        console.print(f"[red]the run failed (exit {code}); logs under {paths.logs}[/]")
    return code


def ensure_tiny_model(model_dir: Path) -> Path:
    """Make the tiny model the first time; reuse it afterwards (it is seeded, so always the same)."""
    if (model_dir / "config.json").exists():
        return model_dir
    from pipeline.tiny_model import make_tiny_model

    console.print(f"making the tiny model in {model_dir} ...")
    return make_tiny_model(model_dir)


def _launch_and_watch(overrides: list[str], paths: RunPaths, steps: int) -> int:
    cmd = [sys.executable, "-m", "pipeline.cli", "launch", str(DEMO_CONFIG), *overrides, "--executor", "local"]
    log = paths.root.parent / f"{paths.root.name}.launcher.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        child = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            with Live(_progress_table(paths, steps, 0.0), console=console, refresh_per_second=2) as live:
                started = time.monotonic()
                while child.poll() is None:
                    live.update(_progress_table(paths, steps, time.monotonic() - started))
                    time.sleep(1.0)
                live.update(_progress_table(paths, steps, time.monotonic() - started))
        except KeyboardInterrupt:
            # The launcher stops every stage on SIGINT; wait so no process outlives the demo.
            child.send_signal(signal.SIGINT)
            child.wait(timeout=60)
            raise
    if child.returncode != 0:
        console.print(f"launcher output: {log}")
    return child.returncode


def _progress_table(paths: RunPaths, steps: int, elapsed: float) -> Table:
    rollout = read_jsonl(paths.rollout_metrics)
    train = read_jsonl(paths.train_metrics)
    table = Table(title=f"arl demo — {elapsed:5.0f}s elapsed", expand=False)
    for column in ("step", "reward", "samples", "train loss", "train tokens/s", "weight version"):
        table.add_column(column, justify="right")
    by_step = {int(r["step"]): r for r in train}
    for record in rollout[-8:]:
        step = int(record["step"])
        trained = by_step.get(step, {})
        table.add_row(
            f"{step + 1}/{steps}",
            _fmt(reward_of(record)),
            _fmt(record.get("samples", record.get("num_samples"))),
            _fmt(trained.get("loss")),
            _fmt(trained.get("tokens_per_s", trained.get("throughput/tokens_per_s"))),
            _fmt(step + 1 if trained else None),
        )
    if not rollout:
        table.add_row("starting", "", "", "", "", "")
    return table


def reward_of(record: dict[str, Any]) -> float | None:
    for key in ("reward_mean", "reward/mean", "reward"):
        if isinstance(record.get(key), int | float):
            return float(record[key])
    return None


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def summarize(paths: RunPaths, elapsed: float) -> None:
    """Reward curve in the terminal and as a PNG, the first-vs-last comparison, the inspect hint."""
    records = read_jsonl(paths.rollout_metrics)
    rewards = [(int(r["step"]), reward) for r in records if (reward := reward_of(r)) is not None]
    if not rewards:
        console.print("no rollout metrics were written")
        return
    values = [r for _, r in rewards]
    console.print(ascii_curve(values))
    k = max(1, len(values) // 5)
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    console.print(f"mean reward, first {k} steps: {first:.3f}   last {k} steps: {last:.3f}   "
                  f"change: [bold]{last - first:+.3f}[/] in {elapsed:.0f}s")  # fmt: skip
    png = save_png(rewards, paths.reward_curve)
    console.print(f"reward curve: {png}")
    console.print(f"inspect the trajectories: [cyan]arl inspect {paths.root} --step {rewards[-1][0]} --decode[/]")


def ascii_curve(values: list[float], height: int = 8) -> str:
    """A small bar chart of one column per step (values in [0, 1] are typical; scaled to the range)."""
    lo, hi = min(0.0, *values), max(1e-9, *values)
    rows = []
    for level in range(height, 0, -1):
        threshold = lo + (hi - lo) * (level - 0.5) / height
        label = f"{lo + (hi - lo) * level / height:5.2f} |" if level in (height, 1) else "      |"
        rows.append(label + "".join("█" if v >= threshold else " " for v in values))
    rows.append("      +" + "-" * len(values) + " step")
    return "reward per step\n" + "\n".join(rows)


def save_png(rewards: list[tuple[int, float]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in rewards], [r for _, r in rewards], marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("arl demo: reward per step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path
