"""Does LoRA learn the demo as full fine-tuning does? Both curves, from one seed, in one figure.

Runs `arl demo` twice with the same seed, as a person runs it: full weights (the shipped config), then LoRA with
the settings of `examples/demo_lora.yaml` (rank 128, alpha 64, lr 5e-4 with LoRA+'s B matrices and the trained
norms at 16x; `--lora-steps` may run it longer).
Per run it reads `metrics/rollout.jsonl` (`agent/exact_correct`: the reply is exactly the number, and the mean
reward) and reports both rates over the first and the last 20% of steps; it draws both exact-correct curves
(10-step moving average) into `--plot`. Goal (issue 22): LoRA's last-20% exact-correct within 0.1 of full
weights'. `--reuse FULL_RUN LORA_RUN` reads two finished demo runs instead of running them (the figures are
the same, only the wall time is not measured).

Usage: python benchmarks/lora_learning.py [--seed 0] [--steps N] [--lora-steps N] [--workdir DIR] [--plot PNG]
       python benchmarks/lora_learning.py --reuse RUN_DIR RUN_DIR [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/lora_learning.py`: for `benchmarks.` imports

from benchmarks.demo_learning import EXACT, SeedRun, run_seed  # noqa: E402

LORA = ["trainer.lora.rank=128", "trainer.lora.alpha=64", "trainer.optimizer.lr=5e-4", "trainer.lora.lr_ratio=16",
        "trainer.lora.modules_to_save=[norm]"]  # fmt: skip
"""examples/demo_lora.yaml's settings, as overrides of the demo's own config."""
GOAL_GAP = 0.1
WINDOW = 10


def main() -> int:
    args = parse_args()
    if args.reuse:
        full, lora = (read_run(Path(p)) for p in args.reuse)
    else:
        from pipeline.demo.demo_run import MODEL_NAME, ensure_tiny_model

        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="arl-lora-learning-")).resolve()
        ensure_tiny_model(workdir / MODEL_NAME)  # one warm-started model for both runs
        full = run_seed(workdir, args.seed, args.steps, [])
        lora = run_seed(workdir, args.seed, args.lora_steps or args.steps, LORA)
    plot(full, lora, Path(args.plot))
    report(full, lora, Path(args.plot))
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's)")
    parser.add_argument("--lora-steps", type=int, default=None, help="the LoRA run's steps (default: --steps)")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--plot", default=str(REPO / "docs" / "lora_learning.png"), help="the figure")
    parser.add_argument("--reuse", nargs=2, metavar=("FULL_RUN", "LORA_RUN"), help="read two finished demo runs")
    return parser.parse_args()


def read_run(run_dir: Path) -> SeedRun:
    """The per-step rates of a finished demo run (its wall time is not known: 0)."""
    from pipeline.run.paths import RunPaths
    from pipeline.run.sinks import read_jsonl

    rows = sorted(read_jsonl(RunPaths(run_dir).rollout_metrics), key=lambda r: int(r["step"]))
    if not rows or any(EXACT not in r for r in rows):
        raise SystemExit(f"{run_dir}: no rollout metrics with {EXACT}; is it a demo run?")
    return SeedRun(0, [float(r[EXACT]) for r in rows], [float(r["reward_mean"]) for r in rows], 0.0)


def smooth(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - WINDOW + 1) : i + 1]) / len(values[max(0, i - WINDOW + 1) : i + 1])
            for i in range(len(values))]  # fmt: skip


def plot(full: SeedRun, lora: SeedRun, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, label in ((full, "full weights"), (lora, "LoRA rank 128 + norms, LoRA+ 16x, lr 5e-4")):
        ax.plot(range(len(run.exact)), smooth(run.exact), label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"exact-correct ({WINDOW}-step moving average)")
    ax.set_ylim(0, 1)
    ax.set_title("arl demo: full fine-tuning vs LoRA (same seed, same warm start)")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def report(full: SeedRun, lora: SeedRun, out: Path) -> None:
    figures: dict[str, Any] = {}
    for name, run in (("full", full), ("LoRA", lora)):
        figures[f"{name} steps"] = len(run.exact)
        figures[f"{name} exact-correct first 20%"] = round(run.fifth(run.exact, False), 3)
        figures[f"{name} exact-correct last 20%"] = round(run.fifth(run.exact, True), 3)
        figures[f"{name} reward last 20%"] = round(run.fifth(run.rewards, True), 3)
        if run.wall_s:
            figures[f"{name} demo wall s"] = round(run.wall_s, 1)
        print(
            f"{name:>5}: {len(run.exact)} steps, exact-correct first 20% {run.fifth(run.exact, False):.3f}, "
            f"last 20% {run.fifth(run.exact, True):.3f}, reward last 20% {run.fifth(run.rewards, True):.3f}"
        )
    gap = full.fifth(full.exact, True) - lora.fifth(lora.exact, True)
    goal = f"LoRA last-20% exact-correct within {GOAL_GAP} of full weights'"
    targets = {goal: "met" if gap <= GOAL_GAP else f"missed (gap {gap:.3f})"}
    print(f"goal {goal}: {targets[goal]}; figure: {out}")
    result = {"name": "lora_learning", "reference": "full fine-tuning, same seed and warm start",
              "figures": figures, "ratios": {}, "targets": targets}  # fmt: skip
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
