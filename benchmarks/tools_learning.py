"""Does `arl demo --task tools` learn its task, and learn the tool? Seeded full demos, then one run each of the
other export style and of a tree discount, on the same model.

Runs `arl demo --task tools --seed N` (the shipped config: an OpenAI Agents SDK agent, a calculator tool, the
real proxy, engine and trainer, as a person runs it) for seeds 0..S-1 under one work dir, so all train the same
warm-started tiny model (made once, before the first run). Per seed, from the run's `metrics/rollout.jsonl` and
its shards: the exact-correct rate (`agent/exact_correct`: the final answer is the sum) at step 0 (the model
before RL) and over the last 20% of the steps, the tool-use rate (`agent/used_tool`: at least one well-formed
calculator call) and the share of samples with at least two model turns over the last 20%, the held-out pass@1
(greedy, on questions never trained on) at the first and last evaluated version, and the wall time.

`--compare` adds, on seed 0: `rollout.export_style=individual` (one row per model call: the tool-call turn is its
own sample, credited through the conversation tree with `rollout.discount`, 1.0 by default), and the same with
`rollout.discount=0.5` (the call turn gets half the final reward): the last-20% exact-correct rate and the tokens
the trainer processed, against the concat seed-0 run.

Goals (issue 37): exact-correct <= 0.05 at step 0 and >= 0.9 over the last 20% on every seed within 15 minutes
of wall time a seed; >= 90% of the last 20%'s episodes use the tool and >= 80% of their samples have >= 2 turns;
concat learns like individual (within 0.1) with <= half the tokens.

Usage: python benchmarks/tools_learning.py [--seeds 3] [--steps N] [--compare] [--workdir DIR] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._workdir import work_dir  # noqa: E402
from benchmarks.demo_learning import SeedRun, run_seed  # noqa: E402

GOALS = {"before": 0.05, "after": 0.9, "wall_s": 15 * 60, "used_tool": 0.9, "two_turns": 0.8, "tokens": 0.5}
USED_TOOL = "agent/used_tool"


@dataclass
class ToolRun:
    label: str
    run: SeedRun
    used_tool: list[float]
    two_turns_last: float
    """Share of the last 20% of steps' samples with >= 2 model turns."""
    tokens: int
    """Tokens the trainer processed over the run (metrics/train.jsonl)."""
    held_out: list[tuple[int, float]] = field(default_factory=list)


def main() -> int:
    args = parse_args()
    from pipeline.demo.tasks import TOOLS, ensure_tiny_model

    with work_dir(args.workdir, "arl-tools-learning-") as workdir:
        ensure_tiny_model(workdir / TOOLS.model_name, TOOLS)  # made once, before any timed run
        runs = [measure(f"seed {s}", run_seed(workdir, s, args.steps, args.set, "tools")) for s in range(args.seeds)]
        compared = []
        if args.compare:
            for label, extra in (
                ("individual", ["rollout.export_style=individual"]),
                ("individual discount 0.5", ["rollout.export_style=individual", "rollout.discount=0.5"]),
            ):
                compared.append(measure(label, run_seed(workdir, 0, args.steps, [*args.set, *extra], "tools")))
    report(runs, compared)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, one full demo each")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    parser.add_argument("--compare", action="store_true", help="also individual export, and a 0.5 discount")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE override for every run")
    return parser.parse_args()


def measure(label: str, run: SeedRun) -> ToolRun:
    from pipeline.demo.curves import eval_series
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import read_step
    from pipeline.run.sinks import read_jsonl

    assert run.run_dir is not None
    paths = RunPaths(run.run_dir)
    rows = sorted(read_jsonl(paths.rollout_metrics), key=lambda r: int(r["step"]))
    steps = [int(r["step"]) for r in rows]
    last = steps[-max(1, len(steps) // 5) :]
    turns = [t for step in last for t in read_step(paths, step).column("num_turns").to_pylist()]
    sessions_two = sum(t >= 2 for t in turns) / len(turns)
    tokens = sum(int(r.get("tokens", 0)) for r in read_jsonl(paths.train_metrics))
    held_out = next(iter(eval_series(paths).values()), [])
    out = ToolRun(label, run, [float(r.get(USED_TOOL, 0.0)) for r in rows], sessions_two, tokens, held_out)
    tool_use = run.fifth(out.used_tool, True)
    print(f"   {label}: exact last 20% {run.fifth(run.exact, True):.3f}, tool use {tool_use:.3f}, "
          f">=2 turns {sessions_two:.3f}, held-out {held_out}, trained tokens {tokens:,}", flush=True)  # fmt: skip
    return out


def report(runs: list[ToolRun], compared: list[ToolRun]) -> None:
    figures: dict[str, Any] = {"seeds": len(runs), "steps": len(runs[0].run.exact)}
    for r in [*runs, *compared]:
        exact = r.run.exact
        figures[f"{r.label} exact-correct before RL (step 0)"] = round(exact[0], 3)
        figures[f"{r.label} exact-correct last 20%"] = round(r.run.fifth(exact, True), 3)
        figures[f"{r.label} tool-use rate last 20%"] = round(r.run.fifth(r.used_tool, True), 3)
        figures[f"{r.label} samples with >= 2 turns, last 20%"] = round(r.two_turns_last, 3)
        if r.held_out:
            figures[f"{r.label} held-out pass@1 first -> last version"] = (
                f"{r.held_out[0][1]:.2f} (v{r.held_out[0][0]}) -> {r.held_out[-1][1]:.2f} (v{r.held_out[-1][0]})"
            )
        figures[f"{r.label} trained tokens"] = r.tokens
        figures[f"{r.label} wall s"] = round(r.run.wall_s, 1)
    afters = [r.run.fifth(r.run.exact, True) for r in runs]
    targets = {
        f"exact-correct <= {GOALS['before']} at step 0 on every seed": _met(
            max(r.run.exact[0] for r in runs), GOALS["before"], False),
        f"exact-correct >= {GOALS['after']} over the last 20% on every seed": _met(min(afters), GOALS["after"], True),
        f"<= {GOALS['wall_s']} s of wall time a seed": _met(max(r.run.wall_s for r in runs), GOALS["wall_s"], False),
        f">= {GOALS['used_tool']} of the last 20%'s episodes use the tool": _met(
            min(r.run.fifth(r.used_tool, True) for r in runs), GOALS["used_tool"], True),
        f">= {GOALS['two_turns']} of the last 20%'s samples have >= 2 turns": _met(
            min(r.two_turns_last for r in runs), GOALS["two_turns"], True),
    }  # fmt: skip
    ratios: dict[str, float] = {}
    if compared:
        individual = compared[0]
        ratios["concat_vs_individual_tokens"] = round(runs[0].tokens / individual.tokens, 3)
        gap = abs(afters[0] - individual.run.fifth(individual.run.exact, True))
        figures["concat vs individual: |exact-correct last 20% difference|"] = round(gap, 3)
        targets[f"concat trains <= {GOALS['tokens']} of individual's tokens"] = _met(
            ratios["concat_vs_individual_tokens"], GOALS["tokens"], False
        )
    for goal, outcome in targets.items():
        print(f"goal {goal}: {outcome}")
    result = {"name": "tools_learning", "reference": "each seed's own step 0 (the warm-started model before RL); "
              "the concat seed-0 run for the export-style and discount runs", "figures": figures, "ratios": ratios,
              "targets": targets}  # fmt: skip
    print("RESULT " + json.dumps(result))


def _met(value: float, goal: float, at_least: bool) -> str:
    ok = value >= goal if at_least else value <= goal
    return "met" if ok else f"missed ({value:.3f})"


if __name__ == "__main__":
    sys.exit(main())
