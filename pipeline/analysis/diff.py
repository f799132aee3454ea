"""`arl diff RUN_A RUN_B`: two runs side by side, as tables and paired sparklines in the terminal, one PNG of
every curve, or JSON. What is compared and how divergence is judged: `pipeline.analysis.compare`."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.analysis.compare import Curve, DiffReport, compare, default_plot_name, load_side, report_json
from pipeline.analysis.divergence import Divergence, NoiseRule
from pipeline.errors import ArlError
from pipeline.run.handoff import write_bytes_atomic

FORMATS = ("table", "json")
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 32


def diff_runs(
    run_a: Path,
    run_b: Path,
    *,
    fmt: str = "table",
    plot: Path | None = None,
    no_plot: bool = False,
    rule: NoiseRule | None = None,
) -> int:
    """The `arl diff` command; returns the exit code (0)."""
    if fmt not in FORMATS:
        raise ArlError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    rule = rule or NoiseRule()
    try:
        rule.check()
    except ValueError as exc:
        raise ArlError(f"--window/--sigmas/--consecutive: {exc}") from None
    a, b = load_side("A", run_a), load_side("B", run_b)
    if a.paths.root == b.paths.root:
        raise ArlError(f"RUN_A and RUN_B are the same run dir ({a.paths.root}): name two different runs")
    report = compare(a, b, rule)
    if not no_plot and (plot is not None or fmt == "table"):
        report.plot = write_plot(report, plot or Path.cwd() / default_plot_name(a, b))
    if fmt == "json":
        sys.stdout.write(json.dumps(report_json(report), indent=2) + "\n")
    else:
        render_report(report)
    return 0


def render_report(report: DiffReport) -> None:
    from rich.table import Table
    from rich.text import Text

    from pipeline.run.console import people_console

    console = people_console(pipe_width=140)
    for side in (report.a, report.b):
        console.print(f"{side.label}: {side.paths.root}  ({side.name})", markup=False, highlight=False)
    console.print(identity_line(report), style="dim", markup=False, highlight=False)
    if report.changes:
        table = Table(title=f"config: {len(report.changes)} difference(s)", title_justify="left")
        for header in ("key", "A", "B"):
            table.add_column(header, overflow="fold")
        for change in report.changes:
            table.add_row(Text(change.key), Text(_value(change.a)), Text(_value(change.b)))
        console.print(table)
    else:
        console.print("config: identical (apart from the identity above)", markup=False, highlight=False)
    if report.curves:
        console.print(curve_table(report))
    console.print(divergence_line(report), markup=False, highlight=False)
    for note in report.notes:
        console.print(f"note: {note}", style="yellow", markup=False, highlight=False)
    if report.plot:
        console.print(f"plot: {report.plot}", markup=False, highlight=False)


def identity_line(report: DiffReport) -> str:
    """`identity: experiment_name demo = demo · trial_name t1 ≠ t2 · ...` (what names a run, not how it runs)."""
    parts = []
    for key, (va, vb) in report.identity.items():
        parts.append(f"{key} {_value(va)}" if va == vb else f"{key} {_value(va)} ≠ {_value(vb)}")
    return "identity: " + " · ".join(parts)


def curve_table(report: DiffReport) -> Any:
    """One row per curve: both runs' sparklines on one scale and one step axis, the mean of the last
    `window` common points of each, and where the curves diverged."""
    from rich.table import Table
    from rich.text import Text

    w = report.rule.window
    title = (
        f"curves: A over B on one scale per curve, x = step (eval: weight version); end = mean of the last {w} "
        "common points (eval: the last common version)"
    )
    table = Table(title=title, title_justify="left")
    for header, justify in (
        ("curve", "left"),
        ("A / B", "left"),
        ("A end", "right"),
        ("B end", "right"),
        ("diverged at", "left"),
    ):
        table.add_column(header, justify=justify, no_wrap=header != "diverged at")  # type: ignore[arg-type]
    for curve in report.curves:
        spark_a, spark_b = sparklines(curve)
        last = 1 if curve.source == "eval" else w
        last_a, last_b = _last_mean(curve, "a", last), _last_mean(curve, "b", last)
        table.add_row(
            Text(curve.name),
            Text(f"{spark_a}\n{spark_b}"),
            Text(f"{_num(last_a)}"),
            Text(f"{_num(last_b)}"),
            Text(_diverged_cell(curve)),
        )
    return table


def _diverged_cell(curve: Curve) -> str:
    d = curve.divergence
    if d is not None:
        return f"step {d.step} (B−A {d.diff:+.3g}, {_z(d)})"
    return curve.note or "no (within noise)"


def divergence_line(report: DiffReport) -> str:
    rule = report.rule
    how = (
        f"a {rule.window}-step window's mean differs by more than {rule.sigmas:g} standard errors (from each "
        f"run's own step-to-step noise) in {rule.consecutive} windows in a row"
    )
    first = report.first_divergence()
    if first is None or first.divergence is None:
        return f"no curve diverged beyond noise ({how})"
    d = first.divergence
    x = "version" if first.source == "eval" else "step"
    return (
        f"first divergence: {first.name} at {x} {d.step} (window {d.window_start}-{d.step}: B−A {d.diff:+.4g}, "
        f"{_z(d)}); diverged = {how}"
    )


def sparklines(curve: Curve, width: int = SPARK_WIDTH) -> tuple[str, str]:
    """Both runs as block characters over the same x range and y scale (a blank: no point in that column)."""
    values = [*curve.a.values(), *curve.b.values()]
    xs = [*curve.a, *curve.b]
    lo, hi = min(values), max(values)
    x0, x1 = min(xs), max(xs)
    columns = min(width, x1 - x0 + 1)

    def line(series: dict[int, float]) -> str:
        cells: list[list[float]] = [[] for _ in range(columns)]
        for x, v in series.items():
            cells[min(columns - 1, (x - x0) * columns // (x1 - x0 + 1))].append(v)
        chars = []
        for cell in cells:
            if not cell:
                chars.append(" ")
                continue
            level = 0 if hi == lo else int((np.mean(cell) - lo) / (hi - lo) * (len(SPARK) - 1) + 0.5)
            chars.append(SPARK[level])
        return "".join(chars)

    return line(curve.a), line(curve.b)


def write_plot(report: DiffReport, target: Path) -> Path:
    """Every curve in one grid, A and B overlaid, a dotted line where they diverged; written atomically."""
    import io

    from matplotlib.figure import Figure

    curves = report.curves
    cols = 3
    rows = max(1, math.ceil(len(curves) / cols))
    fig = Figure(figsize=(5.2 * cols, 2.9 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, curve in zip(axes.flat, curves, strict=False):
        for series, label, colour in ((curve.a, report.a, "tab:blue"), (curve.b, report.b, "tab:orange")):
            steps = sorted(series)
            ax.plot(steps, [series[s] for s in steps], color=colour, lw=1.2, label=f"{label.label}: {label.name}")
        title = curve.name
        if (d := curve.divergence) is not None:
            ax.axvspan(d.window_start, d.step, color="tab:red", alpha=0.08)  # the split is somewhere in here
            ax.axvline(d.step, color="tab:red", ls=":", lw=1.2)
            title += f"  (diverged at {d.step})"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("weight version" if curve.source == "eval" else "step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(curves) :]:
        ax.set_visible(False)
    if curves:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside upper center", ncols=2, fontsize=9)
    else:
        axes.flat[0].text(0.5, 0.5, "no metrics in either run", ha="center", va="center")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    target = Path(os.path.abspath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target, buffer.getvalue())
    return target


def _last_mean(curve: Curve, side: str, window: int) -> float | None:
    steps, va, vb = curve.common()
    values = va if side == "a" else vb
    if not steps.size:  # no common step: the run's own last points
        series = curve.a if side == "a" else curve.b
        values = np.array([series[s] for s in sorted(series)])
    return float(values[-window:].mean()) if values.size else None


def _z(d: Divergence) -> str:
    return f"{abs(d.z):.1f} se" if math.isfinite(d.z) else "noiseless curves"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _value(value: Any) -> str:
    """As config.yaml spells it (true, null, [a, b]); strings bare, never cut (paths are copied from here)."""
    return value if isinstance(value, str) else json.dumps(value)
