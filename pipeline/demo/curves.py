"""The demo's pictures and summary figures: per-step series from `metrics/rollout.jsonl`, terminal bar charts, the
first-vs-last comparison and the PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.demo.tasks import Series
from pipeline.run.paths import RunPaths

Points = list[tuple[int, float]]


def reward_of(record: dict[str, Any]) -> float | None:
    for key in ("reward_mean", "reward/mean", "reward"):
        if isinstance(record.get(key), int | float):
            return float(record[key])
    return None


def series(records: list[dict[str, Any]], key: str) -> Points:
    """(step, value) of `key` in the steps that have it as a number."""
    return [
        (int(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
    ]


def comparison_lines(rewards: list[tuple[int, float]], exact: list[tuple[int, float]], elapsed: float) -> list[str]:
    """First fifth of the steps vs the last fifth, for the reward and (when the agent reports it) the
    exact-correct rate; step 0 is the model before RL."""
    lines = [f"mean reward,   {_first_vs_last(rewards)} in {elapsed:.0f}s"]
    if exact:
        lines.append(f"exact-correct, {_first_vs_last(exact)}   (before RL, step {exact[0][0]}: {exact[0][1]:.3f})")
    return lines


def _first_vs_last(points: Points) -> str:
    """'steps a-b: x   steps c-d: y   change: +z' over the first and the last fifth of `series`."""
    k = max(1, len(points) // 5)
    first, last = points[:k], points[-k:]
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


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (the demo may run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(
    rewards: Points,
    path: Path,
    exact: Points | None = None,
    evaluations: dict[str, Points] | None = None,
    extra: list[tuple[Series, Points]] | None = None,
    title: str = "arl demo",
) -> Path:
    """The reward per step and, when given, the exact-correct rate per step, the held-out evaluations (by weight
    version) and `extra` rates on one [0, 1] axis; `extra` counts (turns per episode) on a panel of their own."""
    plt = pyplot()
    counts = [(spec, points) for spec, points in extra or [] if not spec.unit and points]
    fig, axes = plt.subplots(
        1 + bool(counts), 1, figsize=(6, 5.5 if counts else 3.5), sharex=True, squeeze=False,
        gridspec_kw={"height_ratios": [3, 1.3] if counts else [1]},
    )  # fmt: skip
    ax = axes[0][0]
    _line(ax, rewards, "mean reward", "o")
    if exact:
        _line(ax, exact, "exact-correct", "s")
    for spec, points in extra or []:
        if spec.unit and points:
            _line(ax, points, spec.label, "^")
    for name, points in (evaluations or {}).items():
        _line(ax, points, f"held-out {name} (by version)", "D", markersize=7, linestyle="--")
    if len(ax.get_lines()) > 1:
        ax.legend(loc="center right", fontsize="small")  # where learning curves that rise leave room
    ax.set_ylabel("mean per step")
    ax.set_title(f"{title}: reward and exact-correct per step" if exact else f"{title}: reward per step")
    for spec, points in counts:
        _line(axes[1][0], points, spec.label, ".")
        axes[1][0].set_ylabel(spec.label, fontsize="small")
        axes[1][0].set_ylim(bottom=0)  # a count from zero: 1.98 vs 1.99 calls is not a swing
    for (row,) in axes:
        row.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step (step k is trained into weight version k+1)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def _line(ax: Any, points: Points, label: str, marker: str, markersize: int = 3, linestyle: str = "-") -> None:
    ax.plot([s for s, _ in points], [x for _, x in points], marker=marker, markersize=markersize,
            linestyle=linestyle, label=label)  # fmt: skip
