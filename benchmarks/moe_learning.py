"""Does a mixture-of-experts model learn the demo through arl as the dense one does? Tiny Qwen3-MoE vs tiny Qwen2.

Makes a one-layer tiny Qwen3-MoE (`make-tiny-model --arch qwen3_moe`: a router over 4 experts, top 2) with the demo's
own format-only warm start (the copy task's corpus, steps and learning rate), then runs `arl demo --seed S` on it
(`model.path=` the MoE; everything else the shipped demo: the hf engine serving the MoE, the torch backend training
router and experts) and, for the ratio, the shipped dense demo with the same seed. Per run, from
`metrics/rollout.jsonl`: the exact-correct rate at step 0 and over the last 20% of steps, and the wall time.

Goal (issue 38): the MoE reaches the dense demo's bar, exact-correct >= 0.9 over the last 20% of steps.

Usage: python benchmarks/moe_learning.py [--seed 0] [--steps N] [--workdir DIR] [--no-dense]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/moe_learning.py`: for `benchmarks.` imports

from benchmarks._workdir import work_dir  # noqa: E402
from benchmarks.demo_learning import SeedRun, run_seed  # noqa: E402

GOAL = 0.9


def main() -> int:
    args = parse_args()
    from pipeline.demo.tasks import REPEAT
    from pipeline.demo.tiny_model import make_tiny_model
    from pipeline.demo.warm_start import warm_start

    with work_dir(args.workdir, "arl-moe-learning-") as workdir:
        moe = workdir / f"tiny-moe-L{REPEAT.layers}-warm{REPEAT.warm_steps}"
        if not (moe / "warm_start.json").exists():
            make_tiny_model(moe, arch="qwen3_moe", template="qwen", num_layers=REPEAT.layers, overwrite=True)
            warm_start(moe, REPEAT.warm_corpus, steps=REPEAT.warm_steps, lr=REPEAT.warm_lr)
        runs = {"moe": run_seed(workdir, args.seed, args.steps, [f"model.path={moe}"])}
        if not args.no_dense:
            runs["dense"] = run_seed(workdir, args.seed, args.steps, [])
    report(runs)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's)")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense run (no ratio)")
    return parser.parse_args()


def report(runs: dict[str, SeedRun]) -> None:
    figures: dict[str, float] = {}
    for label, run in runs.items():
        last = run.fifth(run.exact, True)
        print(f"{label:>6}: exact-correct step 0 {run.exact[0]:.3f}, last 20% {last:.3f}, {run.wall_s:.0f} s")
        figures[f"{label} exact-correct step 0"] = round(run.exact[0], 3)
        figures[f"{label} exact-correct last 20%"] = round(last, 3)
        figures[f"{label} wall s"] = round(run.wall_s, 1)
    moe_last = runs["moe"].fifth(runs["moe"].exact, True)
    ratios = {}
    if "dense" in runs:
        dense = runs["dense"]
        ratios["moe / dense wall time"] = round(runs["moe"].wall_s / dense.wall_s, 3)
        ratios["moe - dense exact-correct last 20%"] = round(moe_last - dense.fifth(dense.exact, True), 3)
    target = "met" if moe_last >= GOAL else f"missed: {moe_last:.3f} < {GOAL}"
    result = {"name": "moe_learning", "figures": figures, "ratios": ratios, "reference": "the dense demo, same seed",
              "targets": {f"MoE exact-correct last 20% >= {GOAL}": target}}  # fmt: skip
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
