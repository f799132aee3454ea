"""`arl demo`: a complete local run on a tiny model that learns a task (repeat the number it is asked to).

The demo is an ordinary user of arl: it makes the tiny model if absent (1 layer, warm-started on the
answer format only, see pipeline/demo/warm_start.py), then runs `arl launch examples/demo.yaml --executor
local` as a child process (inference, rollout with an unmodified OpenAI-SDK agent, trainer), watches
the run directory for progress, and at the end draws the reward and exact-correct curves (terminal +
PNG), compares the first and last steps, and prints the `arl inspect` command for the run.
Exact-correct (`agent/exact_correct`, the agent's metric) is the task itself: step 0 measures the
model before RL.

It works from any directory after a plain `pip install`: the config, agent and data come with the
package (`pipeline/examples` is the repository's `examples/`, shipped as package data), the agent
and data are passed to the launcher as absolute paths, and everything the demo writes goes under
`--out` (default `./runs`), printed as absolute paths. Progress is a live table on a terminal and
one line per trained step otherwise (a pipe, `tee`, a log file).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from rich.live import Live
from rich.table import Table

from pipeline.errors import ArlError
from pipeline.launch.rundir import resume_command
from pipeline.run.console import people_console
from pipeline.run.paths import RunPaths
from pipeline.run.progress import StepFeed, StepRecord, step_line, step_table
from pipeline.run.sinks import read_jsonl

EXAMPLES = (Path(__file__).parents[1] / "examples").resolve()
"""The demo's files: the repository's `examples/` in a checkout, package data in an installed wheel."""
DEMO_CONFIG = EXAMPLES / "demo.yaml"
DEMO_AGENT = EXAMPLES / "demo_agent.py"
DEMO_DATA = EXAMPLES / "data" / "demo.jsonl"
DEMO_FORMAT = EXAMPLES / "data" / "demo_format.jsonl"
"""The warm start's corpus: the answer format only (prompts name no number; replies are random)."""
MODEL_LAYERS = 1
"""One layer: it learns to copy by RL within the demo's steps (2-layer models did not, within 100 steps)."""
WARM_START_STEPS = 120
MODEL_NAME = f"tiny-model-L{MODEL_LAYERS}-warm{WARM_START_STEPS}-v2"  # v2: the corpus's short system message
"""The demo's model directory under --out; the name changes with the recipe, so an old model is not reused."""
EXACT_KEY = "agent/exact_correct"
console = people_console()


def demo_file_overrides() -> list[str]:
    """The demo config's agent and dataset as absolute paths, so its run works from any directory."""
    for path in (DEMO_CONFIG, DEMO_AGENT, DEMO_DATA, DEMO_FORMAT):
        if not path.exists():
            raise ArlError(
                f"the demo's file {path} is missing from the installed arl package; reinstall arl "
                "(`pip install --force-reinstall arl`, or `pip install -e .` in a checkout)"
            )
    overrides = [
        f"rollout.agent={_yaml_str(f'{DEMO_AGENT}:DemoAgent')}",
        f"rollout.dataset.path={_yaml_str(str(DEMO_DATA))}",
    ]
    sets = ((yaml.safe_load(DEMO_CONFIG.read_text()) or {}).get("eval") or {}).get("sets") or []
    for spec in sets:  # their data files too (`examples/...` in the config, beside the package's examples)
        path = Path(spec["path"])
        spec["path"] = str(path if path.is_absolute() else EXAMPLES / path.relative_to("examples"))
    if sets:
        overrides.append(f"eval.sets={json.dumps(sets)}")
    return overrides


def run_demo(
    steps: int | None, out: Path, max_staleness: int = 1, overrides: list[str] | None = None, seed: int = 0
) -> int:
    """Run the demo under `out` for `steps` steps (None: the config's `num_steps`); returns the launcher's exit
    status (0 = every stage finished). `overrides` (`key.sub=value`) are passed to `arl launch` after the demo's
    own, so they win. `seed` seeds the dataset order, the trainer and the inference server's sampling."""
    if steps is None:
        steps = int(yaml.safe_load(DEMO_CONFIG.read_text())["num_steps"])
    if steps < 1:
        raise ArlError(f"--steps must be >= 1, got {steps}")
    out = out.expanduser().resolve()
    files = demo_file_overrides()
    model_dir = ensure_tiny_model(out / MODEL_NAME)
    trial = datetime.now().strftime("demo-%Y%m%d-%H%M%S") + (f"-seed{seed}" if seed else "")
    paths = RunPaths.from_config(out, "demo", trial)
    overrides = [
        f"fileroot={_yaml_str(str(out))}",
        f"trial_name={trial}",
        f"num_steps={steps}",
        f"model.path={_yaml_str(str(model_dir))}",
        *files,
        f"rollout.max_staleness={max_staleness}",
        *seed_overrides(seed),
        *(overrides or []),
    ]
    console.print(
        f"[bold]arl demo[/]: {steps} steps (0-{steps - 1}; step k is trained into weight version k+1), "
        f"seed {seed}: RL teaches a tiny model to repeat the number it is asked to"
    )
    console.print(f"run dir: {paths.root}", markup=False, highlight=False)
    started = time.monotonic()
    code = _launch_and_watch(overrides, paths, steps)
    elapsed = time.monotonic() - started
    summarize(paths, elapsed)
    if code == 130:  # Ctrl-C or `arl stop`: a deliberate stop, not a failure
        console.print(
            f"the run was stopped; continue it with: {resume_command(paths, 'local')}", markup=False, highlight=False
        )
    elif code != 0:
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


def seed_overrides(seed: int) -> list[str]:
    """The demo's seeds: dataset order, trainer RNGs, and the inference server's sampling."""
    return [f"rollout.dataset.seed={seed}", f"trainer.seed={seed}", f"inference.extra_args=[--seed, '{seed}']"]


def ensure_tiny_model(model_dir: Path) -> Path:
    """Make the demo's tiny model and its format-only warm start the first time; reuse it afterwards (both
    are seeded, so it is always the same). A directory left without the warm start's record (an interrupted
    build) is rebuilt."""
    from pipeline.demo.warm_start import read_record

    if (model_dir / "config.json").exists() and read_record(model_dir) is not None:
        console.print(_warm_start_line(model_dir, "reusing"), markup=False, highlight=False)
        return model_dir
    from pipeline.demo.tiny_model import make_tiny_model
    from pipeline.demo.warm_start import warm_start

    console.print(f"making the tiny model ({MODEL_LAYERS} layer) in {model_dir} ...", markup=False, highlight=False)
    make_tiny_model(model_dir, num_layers=MODEL_LAYERS, overwrite=True)
    warm_start(model_dir, DEMO_FORMAT, steps=WARM_START_STEPS)
    console.print(_warm_start_line(model_dir, "made"), markup=False, highlight=False)
    return model_dir


def _warm_start_line(model_dir: Path, verb: str) -> str:
    from pipeline.demo.warm_start import read_record

    record = read_record(model_dir)
    assert record is not None
    return (
        f"warm start ({verb}): {record.steps} supervised steps on {Path(record.corpus).name}, the answer format "
        f"only (its prompts name no number; its replies are random two-digit numbers); loss "
        f"{record.first_loss:.2f} -> {record.last_loss:.2f}. Copying the number is left to RL."
    )


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
            if feed.poll():
                _preload_plotting()
            live.update(_progress_table(feed.records(), steps, time.monotonic() - started))
            _wait(child, 1.0)
        feed.poll()
        live.update(_progress_table(feed.records(), steps, time.monotonic() - started))


def _watch_lines(child: subprocess.Popen[bytes], paths: RunPaths, log: Path) -> None:
    """Not on a terminal (a pipe, `tee`, a log file): one line per trained step, as it is trained."""
    console.print(f"launcher output: {log}", markup=False, highlight=False)
    feed = StepFeed(paths)
    started = time.monotonic()
    while True:
        running = child.poll() is None
        records = feed.poll()
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
        _plotting = threading.Thread(target=_pyplot, name="preload-matplotlib", daemon=True)
        _plotting.start()


def _wait(child: subprocess.Popen[bytes], seconds: float) -> None:
    """Up to `seconds`, returning as soon as the launcher exits (a plain sleep held the demo's end up to 1 s)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=seconds)


def _progress_table(records: list[StepRecord], steps: int, elapsed: float) -> Table:
    table = step_table(records[-8:], console)
    table.title = f"arl demo: steps 0-{steps - 1}, {elapsed:.0f}s elapsed" + ("" if records else ", starting")
    return table


def reward_of(record: dict[str, Any]) -> float | None:
    for key in ("reward_mean", "reward/mean", "reward"):
        if isinstance(record.get(key), int | float):
            return float(record[key])
    return None


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (int(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
    ]


def summarize(paths: RunPaths, elapsed: float) -> None:
    """Curves in the terminal and as a PNG, the first-vs-last comparison of reward and exact-correct, the
    inspect hint."""
    records = read_jsonl(paths.rollout_metrics)
    rewards = [(int(r["step"]), reward) for r in records if (reward := reward_of(r)) is not None]
    if not rewards:
        console.print("no rollout metrics were written")
        return
    exact = _series(records, EXACT_KEY)
    console.print(ascii_curve(rewards), markup=False, highlight=False)
    if exact:
        console.print(ascii_curve(exact, title="exact-correct per step"), markup=False, highlight=False)
    for line in comparison_lines(rewards, exact, elapsed):
        console.print(line)
    evaluations = eval_series(paths)
    for name, points in evaluations.items():
        console.print(
            f"held-out evaluation {name}: " + "   ".join(f"version {v}: {x:.3f}" for v, x in points),
            markup=False,
            highlight=False,
        )
    png = save_png(rewards, paths.reward_curve, exact=exact, evaluations=evaluations)
    console.print(f"reward curve: {png}", markup=False, highlight=False)
    console.print("inspect the trajectories:")
    console.print(f"  arl inspect {paths.root} --step {rewards[-1][0]} --decode", markup=False, highlight=False)


def comparison_lines(rewards: list[tuple[int, float]], exact: list[tuple[int, float]], elapsed: float) -> list[str]:
    """First fifth of the steps vs the last fifth, for the reward and (when the agent reports it) the
    exact-correct rate; step 0 is the model before RL."""
    lines = [f"mean reward,   {_first_vs_last(rewards)} in {elapsed:.0f}s"]
    if exact:
        lines.append(f"exact-correct, {_first_vs_last(exact)}   (before RL, step {exact[0][0]}: {exact[0][1]:.3f})")
    return lines


def _first_vs_last(series: list[tuple[int, float]]) -> str:
    """'steps a-b: x   steps c-d: y   change: +z' over the first and the last fifth of `series`."""
    k = max(1, len(series) // 5)
    first, last = series[:k], series[-k:]
    return (
        f"{_span(first)}: {_mean(first):.3f}   {_span(last)}: {_mean(last):.3f}   "
        f"change: [bold]{_mean(last) - _mean(first):+.3f}[/]"
    )


def _span(rewards: list[tuple[int, float]]) -> str:
    lo, hi = rewards[0][0], rewards[-1][0]
    return f"step {lo}" if lo == hi else f"steps {lo}-{hi}"


def _mean(rewards: list[tuple[int, float]]) -> float:
    return sum(r for _, r in rewards) / len(rewards)


def ascii_curve(
    rewards: list[tuple[int, float]], height: int = 8, title: str = "reward per step", width: int = 75
) -> str:
    """A small bar chart, one column per step (per run of consecutive steps, averaged, beyond `width` steps so
    it fits a terminal; values in [0, 1] are typical; scaled to the range), its axis labelled with the first and
    last step numbers."""
    per = -(-len(rewards) // width)  # steps per column, rounded up
    values = [sum(r for _, r in rewards[i : i + per]) / len(rewards[i : i + per]) for i in range(0, len(rewards), per)]
    lo, hi = min(0.0, *values), max(1e-9, *values)
    rows = []
    for level in range(height, 0, -1):
        threshold = lo + (hi - lo) * (level - 0.5) / height
        label = f"{lo + (hi - lo) * level / height:5.2f} |" if level in (height, 1) else "      |"
        rows.append(label + "".join("█" if v >= threshold else " " for v in values))
    rows.append("      +" + "-" * len(values) + (" step" if per == 1 else f" step ({per} steps a column)"))
    first, last = str(rewards[0][0]), str(rewards[-1][0])
    rows.append(
        " " * 7 + first + last.rjust(len(values) - len(first))
        if len(values) > len(first) + len(last)
        else " " * 7 + first
    )
    return title + "\n" + "\n".join(rows)


def eval_series(paths: RunPaths) -> dict[str, list[tuple[int, float]]]:
    """Per eval set, (version, figure) of its newest evaluations: pass@1 where the set scores successes, else the
    mean reward (`metrics/eval.jsonl`)."""
    from pipeline.eval.results import latest_evaluations

    series: dict[str, list[tuple[int, float]]] = {}
    for record in latest_evaluations(paths):
        key = "pass@1" if isinstance(record.get("pass@1"), int | float) else "reward_mean"
        if isinstance(record.get(key), int | float):
            series.setdefault(f"{record['set']} {key}", []).append((int(record["version"]), float(record[key])))
    return series


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (the demo may run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(
    rewards: list[tuple[int, float]],
    path: Path,
    exact: list[tuple[int, float]] | None = None,
    evaluations: dict[str, list[tuple[int, float]]] | None = None,
) -> Path:
    """The reward per step and, when given, the exact-correct rate per step and the held-out evaluations (by
    weight version) on the same [0, 1] axis."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in rewards], [r for _, r in rewards], marker="o", markersize=3, label="mean reward")
    if exact:
        ax.plot([s for s, _ in exact], [r for _, r in exact], marker="s", markersize=3, label="exact-correct")
    for name, points in (evaluations or {}).items():
        ax.plot(
            [v for v, _ in points],
            [x for _, x in points],
            marker="D",
            markersize=7,
            linestyle="--",
            label=f"held-out {name} (by version)",
        )
    if exact or evaluations:
        ax.legend(loc="center right", fontsize="small")  # where learning curves that rise leave room
    ax.set_xlabel("step (step k is trained into weight version k+1)")
    ax.set_ylabel("mean per step")
    ax.set_title("arl demo: reward and exact-correct per step" if exact else "arl demo: reward per step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path
