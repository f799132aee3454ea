"""One finished run of a learning comparison, and the statistics the comparisons share (`benchmarks/vs_trl.py`,
`vs_trl_seeds.py`, `vs_trl_tools.py`): `run_demo` runs an `arl demo` command to its end and reads its run directory
into a `DemoRun`, whose `run` is the `Run` every side of a comparison (arl's and TRL's) is reported as."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TAIL = 0.2
"""Fraction of the last steps whose mean reward is reported."""
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
"""Two-sided 95% Student t quantiles by degrees of freedom (more: 2.0)."""


@dataclass
class Run:
    label: str
    seed: int
    rewards: list[float]
    """Mean reward of each step's samples."""
    reward_at: list[float]
    """Seconds from the process's start until each step's rewards were known."""
    loop_s: float
    """First rollout's start to the last update's end."""
    loop_start: float
    """Seconds from the process's start to the first rollout."""
    process_s: float
    info: dict[str, list[float]] = field(default_factory=dict)
    """Per-step means of what the demo's score reports beside the reward (e.g. exact_correct)."""
    prompts: list[list[tuple[int, ...]]] = field(default_factory=list)
    """Per step, the sorted prompt token ids the samples were generated from."""
    load: float = 0.0
    """The machine's 1-minute load average when the run started."""
    prompts_identical: bool | None = None
    """TRL's runs: whether its prompt token ids equal arl-sync's for the same seed, step by step."""
    timeline: dict[str, float] = field(default_factory=dict)
    """arl: the step timeline's intervals (docs/operations.md), mean seconds per step, by `<stage> <key>`."""
    cpu_s: float = 0.0
    """CPU seconds of every process of the run (the run's process and all it waited for: arl's launcher,
    stages and inference servers), from the OS's accounting of reaped children."""
    run_dir: Path | None = None
    """arl: the run directory the demo made."""


@dataclass
class DemoRun:
    """One finished `arl demo`: its run directory, metrics rows (by step) and what its processes cost."""

    run_dir: Path
    rollout: list[dict[str, Any]]
    train: list[dict[str, Any]]
    started: float
    """time.time() when the command started."""
    process_s: float
    load: float
    cpu_s: float

    def run(self, label: str, seed: int, info: dict[str, list[float]]) -> Run:
        from pipeline.run.paths import RunPaths

        first = float(self.rollout[0]["time"]) - float(self.rollout[0]["time_step_s"])
        return Run(
            label,
            seed,
            rewards=[float(r["reward_mean"]) for r in self.rollout],
            reward_at=[float(r["time"]) - self.started for r in self.rollout],
            loop_s=float(self.train[-1]["time"]) - first,
            loop_start=first - self.started,
            process_s=self.process_s,
            info=info,
            prompts=arl_prompts(RunPaths(self.run_dir), len(self.rollout)),
            load=self.load,
            timeline=arl_timeline(self.rollout, self.train),
            cpu_s=self.cpu_s,
            run_dir=self.run_dir,
        )


def run_demo(cmd: list[str], demo_dir: Path, log: Path, model_dir: Path, steps: int) -> DemoRun:
    """Run an `arl demo` command to its end and read its new run directory under `demo_dir`, checking it trained
    `model_dir` (the model the TRL side loads) for `steps` steps."""
    from pipeline.run.config import config_from_run_dir
    from pipeline.run.paths import RunPaths
    from pipeline.run.sinks import read_jsonl

    before = set(demo_dir.iterdir()) if demo_dir.exists() else set()
    load, started = os.getloadavg()[0], time.time()
    cpu_s = run_logged(cmd, log, {"COLUMNS": "120"})
    process_s = time.time() - started
    (run_dir,) = [p for p in set(demo_dir.iterdir()) - before if p.is_dir()]
    used = Path(config_from_run_dir(run_dir).model.path).resolve()
    if used != model_dir.resolve():
        raise RuntimeError(f"{run_dir} trained {used}, not the model TRL trains ({model_dir})")
    paths = RunPaths(run_dir)
    rollout = sorted(read_jsonl(paths.rollout_metrics), key=lambda r: int(r["step"]))
    train = sorted(read_jsonl(paths.train_metrics), key=lambda r: int(r["step"]))
    if len(rollout) != steps or len(train) != steps:
        raise RuntimeError(f"{run_dir}: {len(rollout)} rollout and {len(train)} train rows for {steps} steps")
    return DemoRun(run_dir, rollout, train, started, process_s, load, cpu_s)


def run_logged(cmd: list[str], log: Path, env_extra: dict[str, str] | None = None) -> float:
    """Run `cmd` to its end; the CPU seconds it and every process it reaped used (user + system)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "wb") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {code}); its output ends:\n{log.read_text()[-3000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def arl_timeline(rollout: list[dict[str, Any]], train: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of every timeline interval both stages record (`time_*_s`, the publication's parts),
    step 0 left out (it includes the stages' start-up waits)."""
    out: dict[str, float] = {}
    for stage, rows in (("rollout", rollout[1:]), ("train", train[1:])):
        extra = ("weight_sync_s", "verify_s", "cpu_s")
        keys = sorted({k for r in rows for k in r if k.startswith("time_") or k in extra})
        for key in keys:
            values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if values:
                out[f"{stage} {key}"] = statistics.fmean(values)
    return out


def arl_info(rollout: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The metrics the agent returns beside its reward (`agent/<name>` in rollout.jsonl, e.g. exact_correct)."""
    keys = sorted({k for r in rollout for k in r if k.startswith("agent/")})
    return {k.removeprefix("agent/"): [float(r.get(k, float("nan"))) for r in rollout] for k in keys}


def arl_prompts(paths: Any, steps: int) -> list[list[tuple[int, ...]]]:
    from pipeline.run.shards import read_step

    out = []
    for step in range(steps):
        table = read_step(paths, step, verify=False, columns=["input_ids", "prompt_len"]).to_pylist()
        out.append(sorted(tuple(r["input_ids"][: r["prompt_len"]]) for r in table))
    return out


def tail_mean(values: list[float]) -> float:
    return statistics.fmean(values[-max(1, round(len(values) * TAIL)) :])


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of the paired differences a - b and the half-width of its 95% interval (nan with one pair)."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    if len(diffs) < 2:
        return statistics.fmean(diffs), float("nan")
    return statistics.fmean(diffs), T95.get(len(diffs) - 1, 2.0) * statistics.stdev(diffs) / len(diffs) ** 0.5
