"""arl against TRL's GRPOTrainer on the demo's experiment, side by side, on the same machine in the same run.

For each seed, three runs of `--steps` steps (default 60: the demo's copy is learned by then, at steps 35-50, and
nine runs of the demo's full 150 steps would take over an hour here), one after the other so a
change in the machine's load touches all three alike:
  trl        TRL 1.16 `GRPOTrainer` in its own process (benchmarks/_trl_grpo.py): the demo's tiny model
             (the very directory `arl demo` uses), the prompts of arl's schedule in arl's order as the
             demo agent writes them (rendered by TRL with the same chat template; the token ids are
             compared with arl's shards), the same group size, batch size, learning rate and schedule,
             Adam settings, clipping, temperature, max new tokens, token-mean loss, no KL, and a reward
             function calling the demo agent's own `score` (benchmarks/_trl_align.py; the option
             mapping is docs/trainer.md, "arl vs TRL's GRPO");
  arl-sync   `arl demo --max-staleness 0` (the real pipeline: inference server, proxy + agent, trainer);
  arl-async  `arl demo --max-staleness 1`.
A seed s sets the prompt order (`rollout.dataset.seed`, the same for the three), arl's trainer and
sampling seeds and TRL's seed. Per step the reward is the mean over the step's batch x group samples.

Printed: per-step mean reward of the three; per run the mean reward over the last 20% of steps, the step
and the wall time at which the reward (a trailing mean over `--smooth` steps) first reaches `--threshold`
(default: half-way from TRL's first-step reward to its last-20% reward, mean over seeds), the training
loop's time (first rollout to last update) and the whole process's time (interpreter start to exit,
TRL's imports and arl's stage start-ups included), and the CPU seconds per step of all the run's processes
(the OS's accounting of reaped children; for arl also each stage's own `cpu_s` per step): on 2 cores a run
cannot step faster than its CPU per step / 2, whatever its design. Goals: arl-sync's reward per step within
noise of TRL's (paired over seeds: the 95% interval of the mean per-seed difference contains 0); arl-async
>= 2x faster than TRL to the threshold (whole process). On a shared machine the times move with its load.
Usage: python benchmarks/vs_trl.py [--seeds 3] [--steps N] [--threshold R] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as `python benchmarks/vs_trl.py`: the root, for `benchmarks.` imports
from benchmarks._demo_runs import (  # noqa: E402
    Run,
    arl_info,
    paired,
    run_demo,
    run_logged,
    tail_mean,
)
from benchmarks._workdir import work_dir  # noqa: E402

TRL_VERSION = "1.16"
LABELS = ("trl", "arl-sync", "arl-async")
GOAL_ASYNC_SPEEDUP = 2.0
GOAL_OVERHEAD_S = 0.2
"""arl's pipeline overhead per step: its training loop's seconds per step less TRL's (the same work in one loop)."""
DEFAULT_STEPS = 60


def main() -> int:
    args = parse_args()
    require_trl()
    from pipeline.demo.demo_run import DEMO_CONFIG, MODEL_NAME, ensure_tiny_model

    steps = args.steps or min(DEFAULT_STEPS, int(_yaml(DEMO_CONFIG)["num_steps"]))
    runs: list[Run] = []
    with work_dir(args.workdir, "arl-vs-trl-") as workdir:
        print(f"vs_trl: {args.seeds} seeds x {steps} steps; TRL, arl-sync, arl-async per seed; work dir {workdir}")
        model_dir = ensure_tiny_model(workdir / MODEL_NAME)  # the directory every run loads (arl demo makes it)
        for seed in range(args.seeds):
            overrides = seed_overrides(seed)
            runs.append(run_trl(workdir, model_dir, steps, seed, overrides))
            for label, staleness in (("arl-sync", 0), ("arl-async", 1)):
                runs.append(run_arl(label, workdir, steps, seed, staleness, overrides))
            report_prompt_check(runs[-3:])
    report(runs, steps, args)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, each running TRL, arl-sync, arl-async")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument("--threshold", type=float, default=None, help="reward to reach (default: see above)")
    parser.add_argument("--smooth", type=int, default=3, help="steps in the trailing mean compared to the threshold")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    args = parser.parse_args()
    if args.seeds < 1 or (args.steps is not None and args.steps < 2):
        parser.error("--seeds must be >= 1 and --steps >= 2")
    return args


def require_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        sys.exit(f"vs_trl: TRL is not installed; run `make bench` or `pip install -e '.[bench]'` (trl {TRL_VERSION})")
    from importlib.metadata import version

    if not version("trl").startswith(TRL_VERSION):
        print(f"warning: trl {version('trl')} installed; the option mapping was checked against {TRL_VERSION}")


def seed_overrides(seed: int) -> list[str]:
    """The same prompt order for the three runs of a seed; arl's trainer and sampling seeds. And a constant
    learning rate after the warm-up, for all three: the demo's cosine spans its 150 steps, and squeezed into
    fewer it would decay while the copy is being learned."""
    from pipeline.demo import demo_run as demo

    return [*demo.seed_overrides(seed), "trainer.optimizer.schedule=constant"]


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load(path.read_text()))


# --------------------------------------------------------------------------- the runs


def run_trl(workdir: Path, model_dir: Path, steps: int, seed: int, overrides: list[str]) -> Run:
    from benchmarks._trl_align import capture_prompts, grpo_config_kwargs, max_completion_tokens, spec_json
    from pipeline.demo.demo_run import DEMO_CONFIG, demo_file_overrides
    from pipeline.run.config import load_config

    config = load_config(DEMO_CONFIG, [*demo_file_overrides(), f"num_steps={steps}", f"model.path={model_dir}",
                                       *overrides])  # fmt: skip
    calls, route = capture_prompts(config, steps)
    if {c.temperature for c in calls} != {config.rollout.temperature}:
        print(f"warning: the agent samples at {sorted({str(c.temperature) for c in calls})}, "
              f"arl's trainer scales by rollout.temperature={config.rollout.temperature}")  # fmt: skip
    options = grpo_config_kwargs(config, max_tokens=max_completion_tokens(config, calls), seed=seed,
                                 output_dir=str(workdir / f"trl-{seed}"))  # fmt: skip
    spec_path, result_path = workdir / f"trl-{seed}.spec.json", workdir / f"trl-{seed}.result.json"
    spec_path.write_text(json.dumps(spec_json(calls, route, config, options, str(model_dir))))
    print(f"-- trl seed {seed}: GRPOTrainer, reward by the demo agent's {route} ...", flush=True)
    load, started = os.getloadavg()[0], time.time()
    # Idle OpenMP threads sleep instead of spinning, as in arl's inference server: on a busy 2-core machine
    # spinning made TRL's steps 6-8x slower (measured 6-8 s vs ~1 s a step).
    omp = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    cpu_s = run_logged([sys.executable, str(HERE / "_trl_grpo.py"), str(spec_path), str(result_path)],
                        workdir / f"trl-{seed}.log", omp)  # fmt: skip
    process_s = time.time() - started
    out = json.loads(result_path.read_text())
    minibatches = config.trainer.minibatches
    info = {k: [step.get(k, float("nan")) for step in out["info"]] for k in set().union(*out["info"])}
    return Run(
        "trl",
        seed,
        rewards=[statistics.fmean(r) for r in out["rewards"]],
        reward_at=[t - started for t in out["reward_times"]],
        loop_s=out["step_ends"][minibatches * steps - 1] - out["train_begin"],
        loop_start=out["train_begin"] - started,
        process_s=process_s,
        info=info,
        prompts=[sorted(map(tuple, ids)) for ids in out["prompt_ids"]],
        load=load,
        cpu_s=cpu_s,
    )


def run_arl(label: str, workdir: Path, steps: int, seed: int, staleness: int, overrides: list[str]) -> Run:
    """`arl demo` as a person runs it (all its processes); its metrics files give the per-step figures."""
    from pipeline.demo.demo_run import MODEL_NAME

    cmd = [sys.executable, "-m", "pipeline.cli", "demo", *overrides, "--steps", str(steps), "--out", str(workdir),
           "--max-staleness", str(staleness)]  # fmt: skip
    print(f"-- {label} seed {seed}: arl demo --max-staleness {staleness} ...", flush=True)
    demo = run_demo(cmd, workdir / "demo", workdir / f"{label}-{seed}.log", workdir / MODEL_NAME, steps)
    return demo.run(label, seed, info=arl_info(demo.rollout))


# --------------------------------------------------------------------------- figures


def report_prompt_check(runs: list[Run]) -> None:
    trl, sync = runs[0], runs[1]
    differing = [k for k, (a, b) in enumerate(zip(trl.prompts, sync.prompts, strict=True)) if a != b]
    verdict = "identical" if not differing else f"DIFFER at steps {differing[:5]}"
    print(f"   prompt token ids, TRL vs arl (seed {trl.seed}, every step, as multisets): {verdict}")
    trl.prompts_identical = not differing


def reached(run: Run, threshold: float, smooth: int) -> int | None:
    """First step whose trailing mean over `smooth` steps is >= threshold."""
    for k in range(len(run.rewards)):
        if statistics.fmean(run.rewards[max(0, k - smooth + 1) : k + 1]) >= threshold:
            return k
    return None


def by_label(runs: list[Run], label: str) -> list[Run]:
    return sorted((r for r in runs if r.label == label), key=lambda r: r.seed)


def report(runs: list[Run], steps: int, args: argparse.Namespace) -> None:
    groups = {label: by_label(runs, label) for label in LABELS}
    trl = groups["trl"]
    threshold = args.threshold
    if threshold is None:
        threshold = statistics.fmean(0.5 * (r.rewards[0] + tail_mean(r.rewards)) for r in trl)
    print_curves(groups, steps)
    rows = print_runs(groups, threshold, args.smooth)
    figures, ratios, targets = summarize(groups, rows, threshold, args.smooth)
    for key, value in {**figures, **ratios, **targets}.items():
        print(f"{key}: {value}")
    print("RESULT " + json.dumps({"name": "vs_trl", "figures": figures, "ratios": ratios, "targets": targets,
                                  "reference": "TRL 1.16 GRPOTrainer, same model, prompts, reward and options, "
                                               "run in the same session (times: whole process)"}))  # fmt: skip


def print_curves(groups: dict[str, list[Run]], steps: int) -> None:
    seeds = [r.seed for r in groups["trl"]]
    short = {"trl": "trl", "arl-sync": "sync", "arl-async": "async"}
    print("\nmean reward per step: mean over seeds, then each seed")
    head = "".join(f"{label:>10}" for label in LABELS)
    head += "  " + "".join(f"{short[label] + str(s):>8}" for s in seeds for label in LABELS)
    print("step" + head)
    for k in range(steps):
        means = "".join(f"{statistics.fmean(r.rewards[k] for r in groups[label]):>10.3f}" for label in LABELS)
        each = "".join(f"{groups[label][i].rewards[k]:>8.3f}" for i in range(len(seeds)) for label in LABELS)
        print(f"{k:>4}" + means + "  " + each)


def print_runs(groups: dict[str, list[Run]], threshold: float, smooth: int) -> dict[str, list[dict[str, Any]]]:
    print(f"\nper run (threshold {threshold:.3f} on the trailing mean of {smooth} steps; times in s from the process's "
          "start, loop = first rollout to last update)")  # fmt: skip
    print(f"{'run':<10}{'seed':>5}{'last 20%':>10}{'step':>6}{'t(thr)':>8}{'loop t(thr)':>12}{'loop':>8}"
          f"{'process':>9}{'s/step':>8}{'load':>6}")  # fmt: skip
    rows: dict[str, list[dict[str, Any]]] = {}
    for label, runs in groups.items():
        for run in runs:
            k = reached(run, threshold, smooth)
            row = {"tail": tail_mean(run.rewards), "step": k, "t": run.reward_at[k] if k is not None else None,
                   "loop_t": run.reward_at[k] - run.loop_start if k is not None else None}  # fmt: skip
            rows.setdefault(label, []).append(row)
            print(f"{label:<10}{run.seed:>5}{row['tail']:>10.3f}{_opt(k, 'd'):>6}{_opt(row['t'], '.1f'):>8}"
                  f"{_opt(row['loop_t'], '.1f'):>12}{run.loop_s:>8.1f}{run.process_s:>9.1f}"
                  f"{run.loop_s / len(run.rewards):>8.2f}{run.load:>6.1f}")  # fmt: skip
    return rows


def _opt(value: float | None, spec: str) -> str:
    return "never" if value is None else format(value, spec)


def summarize(groups: dict[str, list[Run]], rows: dict[str, list[dict[str, Any]]], threshold: float,
              smooth: int) -> tuple[dict[str, Any], dict[str, float], dict[str, str]]:  # fmt: skip
    figures: dict[str, Any] = {
        "seeds": len(groups["trl"]),
        "steps": len(groups["trl"][0].rewards),
        "reward threshold": round(threshold, 3),
        "threshold smoothing (steps)": smooth,
    }
    for label in LABELS:
        each = rows[label]
        figures[f"{label}: reward, last 20% of steps, per seed"] = ", ".join(f"{r['tail']:.3f}" for r in each)
        figures[f"{label}: step reaching the threshold, per seed"] = ", ".join(_opt(r["step"], "d") for r in each)
        figures[f"{label}: s to threshold, whole process, per seed"] = ", ".join(_opt(r["t"], ".1f") for r in each)
        figures[f"{label}: training loop s, mean"] = round(statistics.fmean(r.loop_s for r in groups[label]), 1)
        figures[f"{label}: whole process s, mean"] = round(statistics.fmean(r.process_s for r in groups[label]), 1)
        figures[f"{label}: CPU s per step, all processes, mean"] = round(
            statistics.fmean(r.cpu_s / len(r.rewards) for r in groups[label]), 2)  # fmt: skip
        for key in sorted(set().union(*(r.info for r in groups[label]))):
            figures[f"{label}: {key}, last 20%, per seed"] = ", ".join(
                f"{tail_mean(r.info[key]):.3f}" for r in groups[label] if key in r.info
            )
    for label in ("arl-sync", "arl-async"):
        keys = sorted(set().union(*(r.timeline for r in groups[label])))
        for key in keys:
            values = [r.timeline[key] for r in groups[label] if key in r.timeline]
            figures[f"{label} timeline: {key}, mean s per step"] = round(statistics.fmean(values), 3)
    figures["prompt token ids identical, TRL vs arl (all seeds, all steps)"] = all(
        bool(r.prompts_identical) for r in groups["trl"]
    )
    ratios, targets = compare(groups, rows)
    return figures, ratios, targets


def compare(
    groups: dict[str, list[Run]], rows: dict[str, list[dict[str, Any]]]
) -> tuple[dict[str, float], dict[str, str]]:
    """The paired reward comparison and the speed ratios, with the two goals."""
    trl, sync = groups["trl"], groups["arl-sync"]
    curve, curve_ci = paired([statistics.fmean(r.rewards) for r in sync], [statistics.fmean(r.rewards) for r in trl])
    tail, tail_ci = paired([tail_mean(r.rewards) for r in sync], [tail_mean(r.rewards) for r in trl])
    print(f"\narl-sync - TRL, paired by seed: mean reward over all steps {curve:+.3f} (95% interval +-{curve_ci:.3f}), "
          f"last 20% {tail:+.3f} (+-{tail_ci:.3f})")  # fmt: skip
    same = abs(curve) <= curve_ci and abs(tail) <= tail_ci
    targets = {"arl-sync reward per step within noise of TRL (paired over seeds, 95%)":
               ("met" if same else "missed") + f" (all steps {curve:+.3f} +-{curve_ci:.3f}; last 20% {tail:+.3f} "
               f"+-{tail_ci:.3f})"}  # fmt: skip
    ratios: dict[str, float] = {}
    for label in ("arl-sync", "arl-async"):
        for kind, key in (("whole process", "t"), ("training loop", "loop_t")):
            mine, theirs = [r[key] for r in rows[label]], [r[key] for r in rows["trl"]]
            if None not in mine and None not in theirs:
                ratios[f"TRL / {label} time to threshold ({kind})"] = statistics.fmean(theirs) / statistics.fmean(mine)
        ratios[f"TRL / {label} whole process time"] = statistics.fmean(r.process_s for r in trl) / statistics.fmean(
            r.process_s for r in groups[label]
        )
    for label in ("arl-sync", "arl-async"):
        overhead = statistics.fmean(r.loop_s / len(r.rewards) for r in groups[label]) - statistics.fmean(
            r.loop_s / len(r.rewards) for r in trl)  # fmt: skip
        ratios[f"{label} pipeline overhead, s per step (loop s/step less TRL's)"] = overhead
    for label in ("arl-sync", "arl-async"):
        ratios[f"{label} / TRL CPU seconds, all processes"] = statistics.fmean(r.cpu_s for r in groups[label]) / (
            statistics.fmean(r.cpu_s for r in trl))  # fmt: skip
    overhead = ratios["arl-async pipeline overhead, s per step (loop s/step less TRL's)"]
    targets[f"arl-async (the demo's setting) pipeline overhead <= {GOAL_OVERHEAD_S:g} s per step"] = (
        "met" if overhead <= GOAL_OVERHEAD_S else "missed") + f" ({overhead:.2f} s)"  # fmt: skip
    whole = ratios["TRL / arl-async whole process time"]
    targets["arl demo end to end no slower than TRL's whole process"] = (
        "met" if whole >= 1.0 else "missed") + f" (TRL / arl-async {whole:.2f})"  # fmt: skip
    speedup = ratios.get("TRL / arl-async time to threshold (whole process)")
    goal = f"arl-async >= {GOAL_ASYNC_SPEEDUP:g}x faster than TRL to the threshold (whole process)"
    targets[goal] = ("missed (a run never reached it)" if speedup is None else
                     "met" if speedup >= GOAL_ASYNC_SPEEDUP else f"missed ({speedup:.2f}x)")  # fmt: skip
    return ratios, targets


if __name__ == "__main__":
    sys.exit(main())
