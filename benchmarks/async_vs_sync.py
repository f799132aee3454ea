"""Wall time and learning of the demo run synchronously, and asynchronously with each weight-update mode.

Runs `arl demo --steps N` three times in the same session on the same machine, on the same config:
  sync       `rollout.max_staleness=0`: rollout and training take turns (nothing is in flight when
             weights are published, so the update mode does not matter; the default is used);
  wait       `max_staleness=1`, `inference.update_mode=wait`: the rollout of step k+1 overlaps the
             training of step k; a publication lets the requests in flight finish under the old
             weights while new requests wait, so the server drains (its batch shrinks) first;
  interrupt  `max_staleness=1`, `inference.update_mode=interrupt`: a publication pauses the requests
             in flight, swaps the weights, and they go on under the new ones (partial rollouts).
Speed must not be bought with learning, so beside the wall times it prints the trainer's
`reward_mean` per step of each run (the run's `metrics/train.jsonl`), the `mixed_version_samples`
(samples whose tokens span two weight versions: > 0 only with interrupt) and the mean
`time_publish_s` (with wait it includes the drain).

Settings (overrides, the same for all three runs). As shipped, the demo is train-bound on a CPU: the
rollout of a step (64 replies of at most 6 tokens, all at once) takes ~1 s, a training step several,
so the next step's rollout is finished before the trainer publishes; no request is ever in flight at a
publication and the two update modes cannot differ. They differ when a publication meets requests in
flight (generation the bottleneck, as in real RL runs) whose lengths vary: what `wait` costs is the
drain, the rest of the longest completion in flight while the batch shrinks and new requests are held.
So the runs use `benchmarks/_long_tail_agent.py` (`--agent long_tail`, default): the demo's task and
reward, replies of `--short` tokens (8) and, with probability `--long-share` (0.2), `--long` tokens
(192), as agents' turns are long-tailed; the rollout runs at most `--concurrency` (8) sessions at a
time. `--agent demo` runs the demo agent with `--max-tokens` instead. `--set KEY=VALUE` (repeatable)
adds overrides to every run (e.g. `inference.device=cuda trainer.device=cuda model.path=...` on a GPU).
Goals: interrupt >= 1.15x faster than wait; async interrupt >= 3x faster than sync (overlap alone
gives at most 2x: `max(rollout, train)` instead of their sum, and the stages' start-up is common).
The tiny model is made before the timed runs. Numbers come from one run each: noisy on a shared CPU.
Usage: python benchmarks/async_vs_sync.py [--steps N] [--agent long_tail|demo] [--concurrency C] [--set K=V]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.demo.demo_run import MODEL_NAME, ensure_tiny_model
from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl

REPO_ROOT = Path(__file__).resolve().parent.parent
GOAL_WAIT_OVER_INTERRUPT = 1.15
GOAL_SYNC_OVER_INTERRUPT = 3.0
RUNS = (("sync", 0, "interrupt"), ("wait", 1, "wait"), ("interrupt", 1, "interrupt"))
"""(label, rollout.max_staleness, inference.update_mode)."""


@dataclass
class Run:
    label: str
    wall_s: float
    train: list[dict[str, Any]]
    """The trainer's metrics rows, one per step."""

    def column(self, key: str) -> list[float]:
        return [float(r[key]) for r in sorted(self.train, key=lambda r: int(r["step"])) if key in r]

    @property
    def steady_s_per_step(self) -> float:
        """Seconds per step between the first and the last trained step (start-up excluded)."""
        times = self.column("time")
        return (times[-1] - times[0]) / max(len(times) - 1, 1)


def run_demo(label: str, staleness: int, update_mode: str, args: argparse.Namespace, workdir: Path) -> Run:
    demo_dir = workdir / "demo"
    before = set(demo_dir.iterdir()) if demo_dir.exists() else set()
    overrides = [f"inference.update_mode={update_mode}", f"rollout.max_concurrency={args.concurrency}",
                 *agent_overrides(args), *args.set]  # fmt: skip
    cmd = [sys.executable, "-m", "pipeline.cli", "demo", *overrides, "--steps", str(args.steps),
           "--workdir", str(workdir), "--max-staleness", str(staleness)]  # fmt: skip
    print(f"-- {label}: {' '.join(cmd[3:])}", flush=True)
    started = time.monotonic()
    log = workdir / f"{label}.log"
    with open(log, "wb") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT).returncode
    if code != 0:
        raise RuntimeError(f"the {label} run failed (exit {code}); its output ends:\n{log.read_text()[-4000:]}")
    wall_s = time.monotonic() - started
    (run_dir,) = [p for p in set(demo_dir.iterdir()) - before if p.is_dir()]
    train = read_jsonl(RunPaths(run_dir).train_metrics)
    if len(train) != args.steps:
        raise RuntimeError(f"{run_dir}: {len(train)} train metrics rows for {args.steps} steps")
    return Run(label, wall_s, train)


def agent_overrides(args: argparse.Namespace) -> list[str]:
    if args.agent == "demo":
        return [f"rollout.agent_kwargs={{max_tokens: {args.max_tokens}}}"]
    return [
        "rollout.agent=benchmarks/_long_tail_agent.py:LongTailAgent",
        f"proxy.max_tokens_limit={args.long}",
        f"rollout.agent_kwargs={{short: {args.short}, long: {args.long}, long_share: {args.long_share}}}",
    ]


def print_rewards(runs: list[Run]) -> None:
    print("\nreward_mean per step (trainer)")
    print("step " + "".join(f"{r.label:>11}" for r in runs))
    columns = [r.column("reward_mean") for r in runs]
    for step in range(max(len(c) for c in columns)):
        print(f"{step:>4} " + "".join(f"{c[step]:>11.3f}" if step < len(c) else f"{'-':>11}" for c in columns))


def last3(values: list[float]) -> float:
    return sum(values[-3:]) / len(values[-3:])


def verdict(ratio: float, goal: float) -> str:
    return "met" if ratio >= goal else f"missed ({ratio:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--agent", choices=["long_tail", "demo"], default="long_tail")
    parser.add_argument("--max-tokens", type=int, default=64, help="--agent demo: max_tokens per reply")
    parser.add_argument("--short", type=int, default=8, help="--agent long_tail: tokens of most replies")
    parser.add_argument("--long", type=int, default=192, help="--agent long_tail: tokens of the long replies")
    parser.add_argument("--long-share", type=float, default=0.2, help="--agent long_tail: share of long replies")
    parser.add_argument("--concurrency", type=int, default=8, help="rollout.max_concurrency (64 runs per step)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        ensure_tiny_model(workdir / MODEL_NAME)  # the demo's model, made before any timed run
        runs = [run_demo(label, staleness, mode, args, workdir) for label, staleness, mode in RUNS]
    sync, wait, interrupt = runs
    print_rewards(runs)
    print(f"\n{'run':<10}{'wall s':>8}{'s/step':>8}{'publish s':>11}{'mixed samples':>15}")
    for r in runs:
        publish = sum(r.column("time_publish_s")) / args.steps
        print(f"{r.label:<10}{r.wall_s:>8.1f}{r.steady_s_per_step:>8.2f}{publish:>11.3f}"
              f"{int(sum(r.column('mixed_version_samples'))):>15}")  # fmt: skip
    wait_ratio, sync_ratio = wait.wall_s / interrupt.wall_s, sync.wall_s / interrupt.wall_s
    targets = {
        f"wait / interrupt wall >= {GOAL_WAIT_OVER_INTERRUPT}": verdict(wait_ratio, GOAL_WAIT_OVER_INTERRUPT),
        f"sync / interrupt wall >= {GOAL_SYNC_OVER_INTERRUPT}": verdict(sync_ratio, GOAL_SYNC_OVER_INTERRUPT),
    }
    print(f"\nspeed-up: interrupt vs wait {wait_ratio:.2f}x, interrupt vs sync {sync_ratio:.2f}x, "
          f"wait vs sync {sync.wall_s / wait.wall_s:.2f}x (wall time, start-up included)")  # fmt: skip
    for goal, outcome in targets.items():
        print(f"goal {goal}: {outcome}")
    figures: dict[str, Any] = {"steps": args.steps, "agent": args.agent, "max_concurrency": args.concurrency}
    if args.agent == "long_tail":
        figures.update({"reply tokens": f"{args.short} or {args.long} ({args.long_share:.0%})"})
    else:
        figures["max_tokens"] = args.max_tokens
    for r in runs:
        rewards = r.column("reward_mean")
        figures[f"{r.label} wall s"] = round(r.wall_s, 1)
        figures[f"{r.label} s/step (steady)"] = round(r.steady_s_per_step, 2)
        figures[f"{r.label} reward first step"] = round(rewards[0], 3)
        figures[f"{r.label} reward last 3 steps"] = round(last3(rewards), 3)
    for r in (wait, interrupt):
        figures[f"{r.label} mixed_version_samples"] = int(sum(r.column("mixed_version_samples")))
        figures[f"{r.label} time_publish_s mean"] = round(sum(r.column("time_publish_s")) / args.steps, 3)
    result = {
        "name": "async_vs_sync",
        "reference": "the same demo run with update_mode wait, and synchronously (max_staleness 0)",
        "figures": figures,
        "ratios": {"wait / interrupt wall time": round(wait_ratio, 3),
                   "sync / interrupt wall time": round(sync_ratio, 3),
                   "sync / wait wall time": round(sync.wall_s / wait.wall_s, 3),
                   "wait / interrupt s/step": round(wait.steady_s_per_step / interrupt.steady_s_per_step, 3)},
        "targets": targets,
    }  # fmt: skip
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
