"""Does arl-sync learn like TRL's GRPOTrainer? The reward curves of many seeds, compared phase by phase.

`benchmarks/vs_trl.py` runs three seeds of TRL, arl-sync and arl-async and is mostly about time; three pairs
cannot tell a margin of a few hundredths from the spread of the demo's take-off (the step at which the copy is
found varies by several steps between runs of one seed). This runs only the two learners that must agree, TRL
and arl-sync (`arl demo --max-staleness 0`), exactly as vs_trl.py runs them (the same model, prompts in arl's
order, reward and options; the same functions), for `--seeds` seeds, and compares their rewards:

* paired by seed (same prompt order; with `--prompt-seed`, every run has one prompt order and the seeds vary only
  the random streams of sampling and minibatch order): the mean of the per-seed differences and its 95% Student
  interval, for the mean reward over all steps, over the last 20% of steps, over each sixth of the run, and for
  the step at which the trailing mean first reaches `--threshold`;
* unpaired (Welch): the same figures treating the two sets of runs as independent samples. TRL's runs are
  deterministic given the seed (the same seed repeats its rewards bit for bit), arl's are not (its requests are
  sampled in arrival order), so pairing only shares the prompt order;
* how many seeds arl-sync is above TRL (a sign count);
* that both sides reward the same tokens alike: every arl-sync sample rescored the way TRL's reward function scores
  a completion (TRL's decoding of the completion ids, then the agent's `score`) equals the reward arl recorded.

Goal: arl-sync's reward per step within noise of TRL's: the 95% interval of the paired mean difference contains 0
for the all-steps and last-20% means. Every run's per-step rewards are written to WORKDIR/seeds.json as the runs
end, so a run cut short keeps what it measured.
Usage: python benchmarks/vs_trl_seeds.py [--seeds 10] [--first-seed 0] [--steps 60] [--prompt-seed P] [--workdir DIR]
                                         [--png PATH]
       python benchmarks/vs_trl_seeds.py --report DIR/seeds.json [--png PATH]   (compare saved runs again)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/vs_trl_seeds.py`: the root, for `benchmarks.` imports

from benchmarks._demo_runs import (  # noqa: E402
    T95,
    Run,
    paired,
    tail_mean,
)
from benchmarks._workdir import work_dir  # noqa: E402
from benchmarks.vs_trl import (  # noqa: E402
    DEFAULT_STEPS,
    reached,
    report_prompt_check,
    require_trl,
    run_arl,
    run_trl,
    seed_overrides,
)

DEFAULT_SEEDS = 10
DEFAULT_THRESHOLD = 0.511
"""vs_trl.py's threshold in its last run (half-way from TRL's first-step reward to its last-20% one), fixed here so
that every seed's take-off is measured against the same level."""
WINDOWS = 6
"""The run is cut into this many equal windows of steps, each compared on its own."""


def main() -> int:
    args = parse_args()
    if args.report:
        return finish(*load(Path(args.report)), args)
    require_trl()
    from pipeline.demo.demo_run import MODEL_NAME, ensure_tiny_model

    seeds = range(args.first_seed, args.first_seed + args.seeds)
    pairs: list[tuple[Run, Run]] = []
    rescored: list[tuple[int, int] | None] = []
    with work_dir(args.workdir, "arl-vs-trl-seeds-") as workdir:
        print(f"vs_trl_seeds: seeds {seeds.start}..{seeds.stop - 1} x {args.steps} steps, TRL then arl-sync; work dir "
              f"{workdir}", flush=True)  # fmt: skip
        model_dir = ensure_tiny_model(workdir / MODEL_NAME)
        for seed in seeds:
            overrides = seed_overrides(seed)
            if args.prompt_seed is not None:  # after the seed's own dataset seed: the later override wins
                overrides.append(f"rollout.dataset.seed={args.prompt_seed}")
            trl = run_trl(workdir, model_dir, args.steps, seed, overrides)
            sync = run_arl("arl-sync", workdir, args.steps, seed, 0, overrides)
            report_prompt_check([trl, sync])
            rescored.append(report_rescore(sync))
            pairs.append((trl, sync))
            save(workdir / "seeds.json", pairs, rescored)
            print(f"   seed {seed}: mean reward TRL {statistics.fmean(trl.rewards):.3f}, arl-sync "
                  f"{statistics.fmean(sync.rewards):.3f}", flush=True)  # fmt: skip
    return finish(pairs, rescored, args)


def finish(pairs: list[tuple[Run, Run]], rescored: list[tuple[int, int] | None], args: argparse.Namespace) -> int:
    """Compare, print the figures and the RESULT line, and draw the curves when asked."""
    figures, targets = compare(pairs, args.threshold, args.smooth)
    if rescored and None not in rescored:
        checked, differing = (sum(r[i] for r in rescored if r is not None) for i in (0, 1))
        figures["arl-sync samples rescored as TRL scores them, differing / checked"] = f"{differing} / {checked}"
    if args.png:
        plot(pairs, Path(args.png))
        print(f"curves: {args.png}")
    for key, value in {**figures, **targets}.items():
        print(f"{key}: {value}")
    print("RESULT " + json.dumps({"name": "vs_trl_seeds", "figures": figures, "ratios": {}, "targets": targets,
                                  "reference": "TRL 1.16 GRPOTrainer, same model, prompts, reward and options, "
                                               "one run per seed beside arl-sync's"}))  # fmt: skip
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="how many seeds (TRL + arl-sync each)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (then +1 each)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps per run")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="reward level of the take-off")
    parser.add_argument("--smooth", type=int, default=3, help="steps in the trailing mean compared to the threshold")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    parser.add_argument("--prompt-seed", type=int, default=None,
                        help="one prompt order for every run (default: each seed its own); the seeds then vary only "
                             "the random streams of sampling and minibatch order")  # fmt: skip
    parser.add_argument("--png", default=None, help="draw every seed's curves and their means to this PNG")
    parser.add_argument("--report", default=None, metavar="SEEDS_JSON",
                        help="run nothing: compare the runs saved in a workdir's seeds.json")  # fmt: skip
    args = parser.parse_args()
    if args.seeds < 2 or args.steps < WINDOWS or args.first_seed < 0:
        parser.error(f"--seeds must be >= 2, --steps >= {WINDOWS} and --first-seed >= 0")
    return args


def report_rescore(run: Run) -> tuple[int, int] | None:
    """Rescore the run's samples as TRL's reward function would (`_trl_align.rescore_shards`): the same reward from
    the same tokens on both sides, or the pair could differ for that reason alone."""
    from benchmarks._trl_align import rescore_shards

    assert run.run_dir is not None
    result = rescore_shards(run.run_dir, len(run.rewards))
    if result is None:
        print("   rewards: the agent's reward is not its `score`'s; not rescored")
        return None
    checked, differing = result
    print(f"   rewards of arl's {checked} samples rescored as TRL scores a completion (its decoding, the agent's "
          f"`score`): {len(differing)} differ{''.join(chr(10) + '     ' + d for d in differing[:5])}")  # fmt: skip
    return checked, len(differing)


def save(path: Path, pairs: list[tuple[Run, Run]], rescored: list[tuple[int, int] | None]) -> None:
    """Each seed's per-step rewards and checks, rewritten after every seed (what `--report` reads)."""
    rows = [{"seed": t.seed, "trl": t.rewards, "arl-sync": s.rewards, "prompts_identical": t.prompts_identical,
             "rescored": r} for (t, s), r in zip(pairs, rescored, strict=True)]  # fmt: skip
    path.write_text(json.dumps(rows))


def load(path: Path) -> tuple[list[tuple[Run, Run]], list[tuple[int, int] | None]]:
    rows = json.loads(path.read_text())
    pairs = [(Run("trl", r["seed"], r["trl"], [], 0.0, 0.0, 0.0, prompts_identical=r["prompts_identical"]),
              Run("arl-sync", r["seed"], r["arl-sync"], [], 0.0, 0.0, 0.0)) for r in rows]  # fmt: skip
    return pairs, [tuple(r["rescored"]) if r.get("rescored") else None for r in rows]  # type: ignore[misc]


def plot(pairs: list[tuple[Run, Run]], path: Path) -> None:
    """Every seed's reward curve, thin, and the mean over seeds, thick, for TRL and arl-sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for index, (label, colour) in enumerate((("TRL 1.16 GRPOTrainer", "tab:orange"), ("arl-sync", "tab:blue"))):
        curves = [pair[index].rewards for pair in pairs]
        for curve in curves:
            ax.plot(curve, color=colour, alpha=0.25, linewidth=0.8)
        mean = [statistics.fmean(values) for values in zip(*curves, strict=True)]
        ax.plot(mean, color=colour, linewidth=2.2, label=f"{label}: mean of {len(curves)} seeds")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_title("the demo's task: TRL and arl-sync, same model, prompts, reward and options")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a less mean of b and the half-width of its 95% interval (Welch's unequal-variance t)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return statistics.fmean(a) - statistics.fmean(b), 0.0
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return statistics.fmean(a) - statistics.fmean(b), T95.get(math.floor(dof), 2.0) * se


def compare(pairs: list[tuple[Run, Run]], threshold: float, smooth: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Figures per seed, paired and unpaired differences (arl-sync - TRL) per measure, and the goal."""
    trl, sync = [t for t, _ in pairs], [s for _, s in pairs]
    steps = len(trl[0].rewards)
    mean = statistics.fmean
    measures: dict[str, tuple[list[float], list[float]]] = {
        "mean reward, all steps": ([mean(r.rewards) for r in sync], [mean(r.rewards) for r in trl]),
        "mean reward, last 20%": ([tail_mean(r.rewards) for r in sync], [tail_mean(r.rewards) for r in trl]),
    }
    for w in range(WINDOWS):
        lo, hi = w * steps // WINDOWS, (w + 1) * steps // WINDOWS
        measures[f"mean reward, steps {lo}-{hi - 1}"] = ([mean(r.rewards[lo:hi]) for r in sync],
                                                         [mean(r.rewards[lo:hi]) for r in trl])  # fmt: skip
    takeoffs = [reached(r, threshold, smooth) for r in sync], [reached(r, threshold, smooth) for r in trl]
    if None not in takeoffs[0] and None not in takeoffs[1]:
        measures[f"step reaching {threshold:g}"] = ([float(k) for k in takeoffs[0]], [float(k) for k in takeoffs[1]])  # type: ignore[arg-type]
    figures: dict[str, Any] = {
        "seeds": ", ".join(str(t.seed) for t in trl), "steps": steps,
        "threshold (trailing mean)": f"{threshold:g} ({smooth} steps)",
        "prompt token ids identical, every seed and step": all(bool(t.prompts_identical) for t in trl),
    }  # fmt: skip
    print(f"\narl-sync - TRL over {len(pairs)} seeds (paired: same prompt order; Welch: unpaired)")
    print(f"{'measure':<28}{'TRL':>8}{'arl-sync':>10}{'paired diff':>20}{'Welch diff':>20}{'arl above':>11}")
    for name, (mine, theirs) in measures.items():
        diff, ci = paired(mine, theirs)
        udiff, uci = welch(mine, theirs)
        above = sum(m > t for m, t in zip(mine, theirs, strict=True))
        paired_text, welch_text = f"{diff:+.3f} +-{ci:.3f}", f"{udiff:+.3f} +-{uci:.3f}"
        print(f"{name:<28}{mean(theirs):>8.3f}{mean(mine):>10.3f}{paired_text:>20}{welch_text:>20}"
              f"{f'{above}/{len(pairs)}':>11}")  # fmt: skip
        if "steps" not in name or "all" in name:  # per seed only for the whole-run measures: the table stays short
            digits = ".3f" if "reward" in name else "g"
            figures[f"TRL: {name}, per seed"] = ", ".join(format(v, digits) for v in theirs)
            figures[f"arl-sync: {name}, per seed"] = ", ".join(format(v, digits) for v in mine)
        figures[f"arl-sync - TRL: {name}, paired / Welch (95%)"] = f"{paired_text} / {welch_text}"
        figures[f"arl-sync above TRL: {name}"] = f"{above} of {len(pairs)} seeds"
    all_steps = paired(*measures["mean reward, all steps"])
    tail = paired(*measures["mean reward, last 20%"])
    same = abs(all_steps[0]) <= all_steps[1] and abs(tail[0]) <= tail[1]
    targets = {f"arl-sync reward per step within noise of TRL ({len(pairs)} seeds, paired, 95%)":
               ("met" if same else "missed") + f" (all steps {all_steps[0]:+.3f} +-{all_steps[1]:.3f}; last 20% "
               f"{tail[0]:+.3f} +-{tail[1]:.3f})"}  # fmt: skip
    return figures, targets


if __name__ == "__main__":
    sys.exit(main())
