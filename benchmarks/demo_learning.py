"""Does `arl demo` learn its task on every seed? Three full demos, one per seed, and their exact-correct rates.

Runs `arl demo --seed N` (the shipped config, all its processes, as a person runs it) for seeds 0..S-1
one after the other under one work dir, so all of them train the same warm-started tiny model (made
once, before the first run). Per seed it reads the run's `metrics/rollout.jsonl` and reports the
exact-correct rate (`agent/exact_correct`, the demo agent's metric: the reply is exactly the number)
at step 0 (the model before RL: weight version 0), over the first and the last 20% of the steps, the
mean reward over the last 20%, and the demo's wall time; then the spread of the last-20% rates over
the seeds. Goals: every seed >= 0.8 exact-correct over its last 20% of steps, and <= 0.05 before RL
(the warm start teaches the answer format only, so RL must produce the skill).

Usage: python benchmarks/demo_learning.py [--seeds 3] [--steps N] [--workdir DIR] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._workdir import work_dir  # noqa: E402

GOAL_AFTER = 0.8
GOAL_BEFORE = 0.05
EXACT = "agent/exact_correct"


@dataclass
class SeedRun:
    seed: int
    exact: list[float]
    """Exact-correct rate of each step's samples (step 0 first)."""
    rewards: list[float]
    wall_s: float
    run_dir: Path | None = None

    def fifth(self, values: list[float], last: bool) -> float:
        k = max(1, len(values) // 5)
        part = values[-k:] if last else values[:k]
        return sum(part) / len(part)


def main() -> int:
    args = parse_args()
    from pipeline.demo.demo_run import MODEL_NAME, ensure_tiny_model

    with work_dir(args.workdir, "arl-demo-learning-") as workdir:
        ensure_tiny_model(workdir / MODEL_NAME)  # made once, before any timed run
        runs = [run_seed(workdir, seed, args.steps, args.set) for seed in range(args.seeds)]
    report(runs)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, one full demo each")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's)")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE override for every run")
    return parser.parse_args()


def run_seed(workdir: Path, seed: int, steps: int | None, overrides: list[str], task: str = "repeat") -> SeedRun:
    """One `arl demo --seed N [--task T]`; its rollout metrics give the per-step figures (`SeedRun.run_dir` the
    rest)."""
    import yaml

    from pipeline.demo.tasks import task_named
    from pipeline.run.paths import RunPaths
    from pipeline.run.sinks import read_jsonl

    demo_dir = workdir / str(yaml.safe_load(task_named(task).config.read_text())["experiment_name"])
    before = set(demo_dir.iterdir()) if demo_dir.exists() else set()
    cmd = [sys.executable, "-m", "pipeline.cli", "demo", *overrides, "--seed", str(seed), "--out", str(workdir),
           "--task", task]  # fmt: skip
    if steps is not None:
        cmd += ["--steps", str(steps)]
    print(f"-- seed {seed}: {' '.join(cmd[3:])}", flush=True)
    started = time.monotonic()
    log = workdir / f"demo-seed{seed}.log"
    with open(log, "w") as handle:
        code = subprocess.run(
            cmd, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "120"}
        ).returncode
    wall = time.monotonic() - started
    if code != 0:
        raise RuntimeError(f"arl demo --seed {seed} failed (exit {code}); its output: {log}")
    (run_dir,) = [p for p in set(demo_dir.iterdir()) - before if p.is_dir()]
    rows = sorted(read_jsonl(RunPaths(run_dir).rollout_metrics), key=lambda r: int(r["step"]))
    if any(EXACT not in r for r in rows):
        raise RuntimeError(f"{run_dir}: rollout metrics without {EXACT}; is the agent the demo's?")
    run = SeedRun(seed, [float(r[EXACT]) for r in rows], [float(r["reward_mean"]) for r in rows], wall, run_dir)
    first, last = run.fifth(run.exact, False), run.fifth(run.exact, True)
    print(f"   {len(rows)} steps in {wall:.0f}s: exact-correct step 0 {run.exact[0]:.3f}, first 20% {first:.3f}, "
          f"last 20% {last:.3f}", flush=True)  # fmt: skip
    return run


def report(runs: list[SeedRun]) -> None:
    figures: dict[str, Any] = {"seeds": len(runs), "steps": len(runs[0].exact)}
    print(f"{'seed':>4} {'before RL':>10} {'first 20%':>10} {'last 20%':>9} {'reward last 20%':>16} {'wall s':>7}")
    for r in runs:
        after = r.fifth(r.exact, True)
        print(f"{r.seed:>4} {r.exact[0]:>10.3f} {r.fifth(r.exact, False):>10.3f} {after:>9.3f} "
              f"{r.fifth(r.rewards, True):>16.3f} {r.wall_s:>7.0f}")  # fmt: skip
        figures[f"seed {r.seed} exact-correct before RL (step 0)"] = round(r.exact[0], 3)
        figures[f"seed {r.seed} exact-correct first 20%"] = round(r.fifth(r.exact, False), 3)
        figures[f"seed {r.seed} exact-correct last 20%"] = round(after, 3)
        figures[f"seed {r.seed} reward last 20%"] = round(r.fifth(r.rewards, True), 3)
        figures[f"seed {r.seed} demo wall s"] = round(r.wall_s, 1)
    afters = [r.fifth(r.exact, True) for r in runs]
    figures["exact-correct last 20% min"] = round(min(afters), 3)
    figures["exact-correct last 20% spread (max - min)"] = round(max(afters) - min(afters), 3)
    print(f"exact-correct over the last 20% of steps: min {min(afters):.3f}, max {max(afters):.3f}, "
          f"spread {max(afters) - min(afters):.3f}")  # fmt: skip
    worst_before = max(r.exact[0] for r in runs)
    targets = {
        f"every seed >= {GOAL_AFTER} exact-correct over its last 20% of steps": (
            "met" if min(afters) >= GOAL_AFTER else f"missed (min {min(afters):.3f})"),
        f"exact-correct before RL <= {GOAL_BEFORE} on every seed": (
            "met" if worst_before <= GOAL_BEFORE else f"missed (max {worst_before:.3f})"),
    }  # fmt: skip
    for goal, outcome in targets.items():
        print(f"goal {goal}: {outcome}")
    result = {"name": "demo_learning", "reference": "the demo's own step 0 (the warm-started model before RL)",
              "figures": figures, "ratios": {}, "targets": targets}  # fmt: skip
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
