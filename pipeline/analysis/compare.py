"""What `arl diff RUN_A RUN_B` compares: two runs' configs, and where their curves part ways.

Reads only what each run dir already holds: the resolved `config.yaml` `arl launch` froze there, and
the metrics files (`metrics/rollout.jsonl`, `train.jsonl`, `eval.jsonl`). The config is compared as
the YAML it is (dotted keys), not validated, so a run made by an older arl still compares. Whether a
curve diverged is decided by `pipeline.analysis.divergence` (its docstring states the rule and its limits).
`pipeline.analysis.diff` is the command: it shows this report in the terminal, as JSON and as a PNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline.analysis.divergence import Divergence, NoiseRule, first_divergence
from pipeline.errors import ArlError
from pipeline.run.paths import RunPaths
from pipeline.run.progress import StepRecord, records_of

IDENTITY_KEYS = ("experiment_name", "trial_name", "fileroot")
"""Keys that name a run rather than configure it: they differ between any two runs."""


@dataclass(frozen=True)
class RunSide:
    label: str
    """`A` or `B`."""
    paths: RunPaths
    config: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.config.get('experiment_name', '?')}/{self.config.get('trial_name', '?')}"


@dataclass(frozen=True)
class ConfigChange:
    key: str
    a: Any
    b: Any


ABSENT = "(absent)"
"""Shown for a key one config does not have (a run made by another arl version)."""


@dataclass
class Curve:
    name: str
    source: str
    """`rollout`, `train` or `eval` (x is the weight version for eval, the step otherwise)."""
    a: dict[int, float]
    b: dict[int, float]
    divergence: Divergence | None = None
    note: str = ""

    def common(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        steps = sorted(self.a.keys() & self.b.keys())
        return np.array(steps), np.array([self.a[s] for s in steps]), np.array([self.b[s] for s in steps])


@dataclass
class DiffReport:
    a: RunSide
    b: RunSide
    identity: dict[str, tuple[Any, Any]]
    """Identity keys and keys whose values differ only by the runs' own paths."""
    changes: list[ConfigChange]
    curves: list[Curve]
    rule: NoiseRule
    plot: Path | None = None
    notes: list[str] = field(default_factory=list)

    def first_divergence(self) -> Curve | None:
        diverged = [c for c in self.curves if c.divergence is not None]
        return min(diverged, key=lambda c: c.divergence.step if c.divergence else 0, default=None)


def load_side(label: str, path: Path) -> RunSide:
    """A run dir's resolved config; a one-line error for anything that is not a run dir."""
    paths = RunPaths(Path(path).resolve())
    if not paths.root.is_dir():
        raise ArlError(f"RUN_{label} {path} is not a directory")
    if not paths.config.exists():
        raise ArlError(f"RUN_{label} {path} is not a run dir (no config.yaml; `arl launch` writes one)")
    try:
        config = yaml.safe_load(paths.config.read_text())
    except yaml.YAMLError as exc:
        raise ArlError(f"{paths.config}: not valid YAML ({exc})") from None
    if not isinstance(config, dict):
        raise ArlError(f"{paths.config}: not a YAML mapping")
    return RunSide(label, paths, config)


def compare(a: RunSide, b: RunSide, rule: NoiseRule) -> DiffReport:
    identity, changes = config_diff(a, b)
    curves = metric_curves(a.paths, b.paths)
    for curve in curves:
        steps, va, vb = curve.common()
        if not curve.a or not curve.b:
            curve.note = f"only in {'A' if curve.a else 'B'}"
        elif steps.size < rule.min_steps:
            curve.note = f"{steps.size} common points, {rule.min_steps} needed to judge divergence"
        else:
            curve.divergence = first_divergence(steps, va, vb, rule)
    report = DiffReport(a, b, identity, changes, curves, rule)
    if not curves:
        report.notes.append("neither run has metrics (metrics/*.jsonl): only the configs are compared")
    return report


# -- configs ------------------------------------------------------------------------------------
def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists and scalars are leaves (a list is one value)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def config_diff(a: RunSide, b: RunSide) -> tuple[dict[str, tuple[Any, Any]], list[ConfigChange]]:
    """(identity, changes): identity keys, plus keys whose values differ only by the runs' own paths
    (`model.path` under each run's fileroot), go to identity; every other difference is a change."""
    flat_a, flat_b = flatten(a.config), flatten(b.config)
    prefixes = [
        (str(a.paths.root), str(b.paths.root)),
        (str(a.config.get("fileroot", "")), str(b.config.get("fileroot", ""))),
    ]
    identity: dict[str, tuple[Any, Any]] = {k: (flat_a.get(k), flat_b.get(k)) for k in IDENTITY_KEYS}
    changes = []
    for key in sorted(flat_a.keys() | flat_b.keys(), key=_key_order(flat_a, flat_b)):
        if key in IDENTITY_KEYS:
            continue
        va, vb = flat_a.get(key, ABSENT), flat_b.get(key, ABSENT)
        if va == vb:
            continue
        if _same_but_for_prefix(va, vb, prefixes):
            identity[key] = (va, vb)
        else:
            changes.append(ConfigChange(key, va, vb))
    return identity, changes


def _key_order(flat_a: dict[str, Any], flat_b: dict[str, Any]) -> Callable[[str], int]:
    """Keys in the order config.yaml lists them (A's, then keys only B has)."""
    order = {k: i for i, k in enumerate([*flat_a, *(k for k in flat_b if k not in flat_a)])}
    return lambda key: order[key]


def _same_but_for_prefix(va: Any, vb: Any, prefixes: list[tuple[str, str]]) -> bool:
    if not (isinstance(va, str) and isinstance(vb, str)):
        return False
    for pa, pb in prefixes:
        if pa and pb and pa != pb and va.startswith(pa) and vb.startswith(pb) and va[len(pa) :] == vb[len(pb) :]:
            return True
    return False


# -- curves -------------------------------------------------------------------------------------
STEP_CURVES: tuple[tuple[str, str, Callable[[StepRecord], float | None]], ...] = (
    ("reward", "rollout", lambda r: r.reward),
    ("reward std", "rollout", lambda r: r.number("rollout", "reward_std")),
    ("length", "rollout", lambda r: r.number("rollout", "sample_len_mean")),
    ("sampled", "rollout", lambda r: r.sampled_per_sample),
    ("loss", "train", lambda r: r.number("train", "loss")),
    ("kl ref", "train", lambda r: r.number("train", "kl_ref")),
    ("kl behav k3", "train", lambda r: r.number("train", "kl_behav_k3")),
    ("entropy", "train", lambda r: r.number("train", "entropy")),
    ("grad norm", "train", lambda r: r.number("train", "grad_norm")),
    ("clip frac", "train", lambda r: r.number("train", "clip_frac")),
)
"""The curves every run has, in the order shown: `length` is tokens per sample (prompt and completion),
`sampled` completion tokens per sample, `kl ref` the KL to the reference model (only with `kl_coef`),
`kl behav k3` the trainer's k3 estimate of KL(behaviour || current). Per-agent (`agent/…`) and per-task
(`task/<name>/reward_mean`) rollout series follow, then the eval sets' figures."""


def metric_curves(pa: RunPaths, pb: RunPaths) -> list[Curve]:
    """Every curve either run logged, per step (rollout, train) or per weight version (eval)."""
    ra, rb = records_of(pa), records_of(pb)
    curves = [Curve(name, source, _series(ra, value), _series(rb, value)) for name, source, value in STEP_CURVES]
    extra = sorted({k for r in [*ra, *rb] for k in r.rollout if k.startswith("agent/") or _is_task_reward(k)})
    for key in extra:
        curves.append(Curve(key, "rollout", _rollout_series(ra, key), _rollout_series(rb, key)))
    curves += eval_curves(pa, pb)
    return [c for c in curves if c.a or c.b]


def _is_task_reward(key: str) -> bool:
    return key.startswith("task/") and key.endswith("/reward_mean") and key.count("/") == 2


def _rollout_series(records: list[StepRecord], key: str) -> dict[int, float]:
    return _series(records, lambda r: r.number("rollout", key))


def _series(records: list[StepRecord], value: Callable[[StepRecord], float | None]) -> dict[int, float]:
    out = {}
    for record in records:
        v = value(record)
        if v is not None and math.isfinite(v):
            out[record.step] = float(v)
    return out


def eval_curves(pa: RunPaths, pb: RunPaths) -> list[Curve]:
    """`eval <set> <figure>` per weight version: the mean reward and every pass@k the sets logged."""
    from pipeline.eval.results import latest_evaluations

    per_run = []
    for paths in (pa, pb):
        series: dict[tuple[str, str], dict[int, float]] = {}
        for record in latest_evaluations(paths):
            for key, value in record.items():
                if (key == "reward_mean" or key.startswith("pass@")) and isinstance(value, int | float):
                    series.setdefault((str(record["set"]), key), {})[int(record["version"])] = float(value)
        per_run.append(series)
    keys = sorted(per_run[0].keys() | per_run[1].keys())
    return [Curve(f"eval {s} {k}", "eval", per_run[0].get((s, k), {}), per_run[1].get((s, k), {})) for s, k in keys]


# -- output -------------------------------------------------------------------------------------
def default_plot_name(a: RunSide, b: RunSide) -> str:
    def slug(side: RunSide) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in side.paths.root.name)

    return f"arl-diff-{slug(a)}-vs-{slug(b)}.png"


def report_json(report: DiffReport) -> dict[str, Any]:
    def side(s: RunSide) -> dict[str, Any]:
        return {"path": str(s.paths.root), "name": s.name}

    def div(d: Divergence | None) -> dict[str, Any] | None:
        if d is None:
            return None
        return {"step": d.step, "window_start": d.window_start, "diff": d.diff, "se": d.se, "z": _finite(d.z)}

    first = report.first_divergence()
    return {
        "a": side(report.a),
        "b": side(report.b),
        "identity": {k: {"a": va, "b": vb} for k, (va, vb) in report.identity.items()},
        "config": [{"key": c.key, "a": c.a, "b": c.b} for c in report.changes],
        "rule": {"window": report.rule.window, "sigmas": report.rule.sigmas, "consecutive": report.rule.consecutive},
        "curves": [
            {
                "name": c.name,
                "source": c.source,
                "x": "version" if c.source == "eval" else "step",
                "a": _points(c.a),
                "b": _points(c.b),
                "divergence": div(c.divergence),
                "note": c.note or None,
            }
            for c in report.curves
        ],
        "first_divergence": None if first is None else {"curve": first.name, **(div(first.divergence) or {})},
        "plot": str(report.plot) if report.plot else None,
        "notes": report.notes,
    }


def _points(series: dict[int, float]) -> dict[str, list[Any]]:
    steps = sorted(series)
    return {"steps": steps, "values": [series[s] for s in steps]}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
