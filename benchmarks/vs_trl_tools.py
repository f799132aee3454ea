"""arl against TRL's GRPOTrainer on the multi-turn tool task of `arl demo --task tools`, side by side, per seed.

The task (examples/tools_agent.py): "What is 673 + 58?" (rows {id, a, b}; the truth is a + b); the agent calls its
stateless `calculator(expression)` tool, reads the result and answers "The answer is N."; the reward is the task's
`score` of the final answer (1 if right, else 0.5 x closeness within 100, 0 if not a number). For each seed, two
runs of `--steps` steps (default: examples/tools.yaml's num_steps), one after the other so a change in the
machine's load touches both alike, on one model (`--model`, else the task's tiny model made in the work dir):
  trl        TRL 1.16 `GRPOTrainer` in its own process (benchmarks/_trl_tools.py) with its multi-turn tool loop,
             given the tool as a plain function (`tools=[calculator]`, calling the task's own `calculate`; no
             `environment_factory`: the tool keeps no state, and the agent's count of well-formed calls, all that
             used_tool needs, is read off the episode's messages in the reward function); the reward is the task's
             own `outcome` of the final assistant message. Its prompts are arl's schedule in arl's order as the
             agent (OpenAI Agents SDK) writes them, rendered with the SDK's strict tool schema (`get_json_schema`
             patched for the calculator function only; checked to be the module's `CALCULATOR_TOOL`), checked token
             for token against arl's shards; the options are examples/tools.yaml's (`_trl_align.grpo_config_kwargs`:
             lr, warm-up, cosine schedule and min_lr_ratio, Adam eps, grad clip, kl_coef as beta, group size, batch,
             minibatches, temperature, token-level loss) plus the agent's turn limits below;
  arl-sync   `arl demo --task tools --max-staleness 0` (the real pipeline: inference server, proxy, the unmodified
             Agents SDK agent, trainer), in-run evaluation off (TRL runs none).
A seed s sets the prompt order (`rollout.dataset.seed`, the same for both), arl's trainer and sampling seeds and
TRL's seed. Per step the reward and the exact-correct rate are means over the step's batch x group episodes.

What TRL's loop expresses as the agent's, and what it cannot:
* turns: the agent allows `max_turns` (3) model calls of `max_tokens` (40) each; TRL gets
  `max_tool_calling_iterations = max_turns - 1` and `generation_kwargs={"max_new_tokens": 40}` (each generate call,
  first turn and post-tool turns alike), and `max_completion_length` (its budget for the whole episode) is what
  arl's `model.max_context` leaves after the prompt, as arl's proxy caps each call by the context's room. An episode
  whose last allowed turn calls the tool again scores 0 on both sides (the SDK raises MaxTurnsExceeded, the agent
  answers ""; TRL stops with a tool-call message, scored as ""). The SDK runs that last call's tool, TRL does not;
  it can only count towards used_tool, and both sides count it (TRL's from the messages).
* tool calls: TRL parses them with the Qwen2.5 response template of its own `add_response_schema` (set by hand:
  the tiny model's template is Qwen2.5's with extensions TRL does not recognise), arl's proxy with its `hermes`
  parser. They agree on well-formed calls and on a `<tool_call>` block whose JSON does not parse (text: the final
  answer, scored 0). They differ on a complete call not closed by `</tool_call>` before the end of the turn (a call
  for arl, text for TRL) and on a call naming another tool (the SDK raises and arl drops the episode, counted in
  `agent_errors` below; TRL answers `{'error': ...}` and goes on). The arguments are checked as the SDK checks
  them (other keys ignored; a missing or non-string `expression` gets the SDK's refusal sentence, not a result).
* tokens: both train the sampled tokens as sampled, with the tool results masked out; TRL inserts the tool span
  from its template rendering (`_get_tool_suffix_ids`), arl's proxy from the agent's next request. The spans are
  compared for every tool result both runs produced (below). A prefix break in arl (`prefix_breaks` below) cuts
  an episode into two rows, TRL never does.
* timing: TRL generates with `model.generate` in its training process (one step's episodes as one batch per
  turn); arl's inference server batches requests as they arrive.

Printed: per-step mean reward and exact-correct rate of both, each seed; per run the tail (last 20%) reward,
exact-correct, tool-use rate and model calls per episode, the training loop's and the whole process's time and CPU
seconds per step; arl-sync - TRL paired by seed (mean difference and its 95% Student interval over all steps and
over the last 20%, for the reward and the exact-correct rate). Goal: arl-sync's reward per step within noise of
TRL's (the 95% interval of the paired mean difference contains 0). On a shared machine the times move with its load.
Cost: at the config's batch (32 prompts x 8) a step took ~13-30 s of TRL and ~25-30 s of arl-sync on a busy
2-core machine (measured on an earlier version of this task, with episodes of similar length), so the defaults
(5 seeds x 100 steps) run for hours, past `arl bench`'s one-hour limit per script: run it directly, or with fewer
--seeds/--steps.
Usage: python benchmarks/vs_trl_tools.py [--seeds 5] [--steps N] [--workdir DIR] [--model DIR] [--batch-size B]
"""

from __future__ import annotations

import argparse
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
    sys.path.insert(0, str(REPO_ROOT))  # run as `python benchmarks/vs_trl_tools.py`: the root, for `benchmarks.`

from benchmarks._demo_runs import (  # noqa: E402
    Run,
    arl_info,
    paired,
    run_demo,
    run_logged,
    tail_mean,
)
from benchmarks._workdir import work_dir  # noqa: E402
from benchmarks.vs_trl import (  # noqa: E402
    _yaml,
    require_trl,
)

LABELS = ("trl", "arl-sync")
METRICS = ("reward", "exact_correct")
DEFAULT_SEEDS = 5


def main() -> int:
    args = parse_args()
    require_trl()
    from pipeline.demo.tasks import TOOLS

    steps = args.steps or TOOLS.num_steps()
    runs: list[Run] = []
    checks: dict[int, dict[str, Any]] = {}
    with work_dir(args.workdir, "arl-vs-trl-tools-") as workdir:
        print(f"vs_trl_tools: {args.seeds} seeds x {steps} steps; TRL, arl-sync per seed; work dir {workdir}")
        model_dir = prepare_model(workdir, args.model)
        for seed in range(args.seeds):
            overrides = run_overrides(args.batch_size)
            trl, checks[seed] = run_trl(workdir, model_dir, steps, seed, overrides)
            sync = run_arl(workdir, model_dir, steps, seed, overrides)
            runs += [trl, sync]
            checks[seed].update(compare_tokens(trl, sync, checks[seed].pop("tool_spans"), model_dir))
            print_checks(seed, checks[seed])
    report(runs, checks, steps)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds 0..N-1, each running TRL, arl-sync")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: examples/tools.yaml's)")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    parser.add_argument("--model", default=None, help="the task's tiny model, already made (default: make it)")
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per step (default: the config's)")
    args = parser.parse_args()
    if args.seeds < 1 or (args.steps is not None and args.steps < 2):
        parser.error("--seeds must be >= 1 and --steps >= 2")
    return args


def prepare_model(workdir: Path, model: str | None) -> Path:
    """The directory both sides train: `arl demo --task tools --out WORKDIR` trains WORKDIR/<the task's model name>
    (making it there when absent), so a given model is linked there."""
    from pipeline.demo.tasks import TOOLS, ensure_tiny_model

    target = workdir / TOOLS.model_name
    workdir.mkdir(parents=True, exist_ok=True)
    if model is not None:
        source = Path(model).expanduser().resolve()
        if target.is_symlink() or target.exists():
            if target.resolve() != source:
                raise SystemExit(f"vs_trl_tools: {target} exists and is not --model {source}")
        else:
            target.symlink_to(source, target_is_directory=True)
    return ensure_tiny_model(target, TOOLS)  # reuses a made model (its warm-start record), else makes it


def run_overrides(batch_size: int | None) -> list[str]:
    """Both sides: no in-run evaluation (TRL runs none); `--batch-size` prompts per step."""
    out = ["eval.every=null", "eval.at_start=false"]
    return out + ([f"rollout.batch_size={batch_size}"] if batch_size else [])


# --------------------------------------------------------------------------- the runs


def run_trl(workdir: Path, model_dir: Path, steps: int, seed: int, overrides: list[str]) -> tuple[Run, dict[str, Any]]:
    from benchmarks._trl_tools import capture_tool_prompts, tool_spec
    from pipeline.demo import demo_run
    from pipeline.demo.tasks import TOOLS, demo_file_overrides
    from pipeline.run.config import load_config

    config = load_config(TOOLS.config, [*demo_file_overrides(TOOLS), f"num_steps={steps}", f"model.path={model_dir}",
                                        *demo_run.seed_overrides(seed), *overrides])  # fmt: skip
    calls = capture_tool_prompts(config, steps)
    spec = tool_spec(config, calls, seed=seed, output_dir=str(workdir / f"trl-{seed}"), model_path=str(model_dir))
    spec_path, result_path = workdir / f"trl-{seed}.spec.json", workdir / f"trl-{seed}.result.json"
    spec_path.write_text(json.dumps(spec))
    print(f"-- trl seed {seed}: GRPOTrainer with tools=[calculator], the task's calculate and outcome ...", flush=True)
    load, started = os.getloadavg()[0], time.time()
    omp = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}  # as vs_trl.py: idle threads sleep
    cpu_s = run_logged([sys.executable, str(HERE / "_trl_tools.py"), str(spec_path), str(result_path)],
                        workdir / f"trl-{seed}.log", omp)  # fmt: skip
    process_s = time.time() - started
    out = json.loads(result_path.read_text())
    info = {k: [step.get(k, float("nan")) for step in out["info"]] for k in set().union(*out["info"])}
    ends = out["step_ends"][config.trainer.minibatches * steps - 1]
    run = Run("trl", seed, rewards=[statistics.fmean(r) for r in out["rewards"]],
              reward_at=[t - started for t in out["reward_times"]], loop_s=ends - out["train_begin"],
              loop_start=out["train_begin"] - started, process_s=process_s, info=info,
              prompts=[sorted(map(tuple, ids)) for ids in out["prompt_ids"]], load=load, cpu_s=cpu_s)  # fmt: skip
    same_schema = _module_tool(config) == spec["tools"][0]
    checks = {**out["checks"], "tool_spans": out["tool_spans"], "sdk_schema_is_CALCULATOR_TOOL": same_schema,
              "trl_log": _log_means(out["log"])}  # fmt: skip
    return run, checks


def _module_tool(config: Any) -> Any:
    from benchmarks._trl_align import agent_namespace
    from pipeline.agents.loading import resolve_agent

    rollout = config.rollout
    return agent_namespace(resolve_agent(rollout.agent, rollout.agent_kwargs, mode=rollout.mode)).get("CALCULATOR_TOOL")


def _log_means(log: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("tools/call_frequency", "tools/failure_frequency", "completions/mean_length", "completions/clipped_ratio")
    return {k: statistics.fmean(r[k] for r in log if k in r) for k in keys if any(k in r for r in log)}


def run_arl(workdir: Path, model_dir: Path, steps: int, seed: int, overrides: list[str]) -> Run:
    """`arl demo --task tools --max-staleness 0` as a person runs it; its metrics files give the per-step figures."""
    from pipeline.demo.tasks import TOOLS

    cmd = [sys.executable, "-m", "pipeline.cli", "demo", *overrides, "--task", "tools", "--seed", str(seed),
           "--steps", str(steps), "--out", str(workdir), "--max-staleness", "0"]  # fmt: skip
    print(f"-- arl-sync seed {seed}: arl demo --task tools --max-staleness 0 ...", flush=True)
    demo_dir = workdir / str(_yaml(TOOLS.config)["experiment_name"])
    demo = run_demo(cmd, demo_dir, workdir / f"arl-sync-{seed}.log", model_dir, steps)
    info = {**arl_info(demo.rollout), "turns_mean": [float(r.get("turns_mean") or 0.0) for r in demo.rollout]}
    for key in ("agent_errors", "prefix_breaks", "samples"):
        info[key] = [float(r.get(key) or 0.0) for r in demo.rollout]
    return demo.run("arl-sync", seed, info)


# --------------------------------------------------------------------------- token checks


def compare_tokens(trl: Run, sync: Run, trl_spans: list[dict[str, list[int]]], model_dir: Path) -> dict[str, Any]:
    """TRL's prompt token ids against arl's shards (per step, as multisets), and the tool spans (the tokens
    between two model turns) of every tool result both runs produced."""
    differing, dropped = [], 0
    for k, (a, b) in enumerate(zip(trl.prompts, sync.prompts, strict=True)):
        missing = _dropped_episodes(a, b, int(sync.info["agent_errors"][k]))
        if missing is None:
            differing.append(k)
        else:
            dropped += missing
    trl.prompts_identical = not differing
    detail = ""
    if differing:
        a, b = trl.prompts[differing[0]], sync.prompts[differing[0]]
        at = next((i for i, (x, y) in enumerate(zip(a[0], b[0], strict=False)) if x != y), min(len(a[0]), len(b[0])))
        detail = f"step {differing[0]}: {len(a)} vs {len(b)} rows, first prompt differs at token {at}"
    theirs: dict[str, list[int]] = {}
    for step in trl_spans:
        for text, ids in step.items():
            theirs.setdefault(text, ids)
    ours = arl_tool_spans(sync, model_dir)
    shared = sorted(set(theirs) & set(ours))
    unequal = [t for t in shared if theirs[t] != ours[t]]
    return {"prompts_identical": not differing, "prompts_differ_at_steps": differing[:5], "prompts_detail": detail,
            "episodes_arl_dropped": dropped,
            "tool_spans_shared": len(shared), "tool_spans_differing": len(unequal),
            "tool_span_example": {"text": shared[0], "ids": theirs[shared[0]]} if shared else None}  # fmt: skip


def _dropped_episodes(trl: list[Any], arl: list[Any], agent_errors: int) -> int | None:
    """How many of a step's TRL prompts arl has no row for, if that is all that differs and no more than the step's
    episodes the agent raised in (arl records none of those: a call naming another tool makes the SDK raise); None
    if arl has a prompt TRL lacks, or misses more than that."""
    from collections import Counter

    theirs, ours = Counter(trl), Counter(arl)
    if ours - theirs:
        return None
    missing = sum((theirs - ours).values())
    return missing if missing <= agent_errors else None


def arl_tool_spans(run: Run, model_dir: Path) -> dict[str, list[int]]:
    """{tool results' text: the unsampled tokens between two model turns} over an arl run's shards (the text is
    what the template wraps in <tool_response> ... </tool_response>)."""
    import re

    from transformers import AutoTokenizer

    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import read_step

    assert run.run_dir is not None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    paths = RunPaths(run.run_dir)
    out: dict[str, list[int]] = {}
    response = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
    for step in range(len(run.rewards)):
        table = read_step(paths, step, verify=False, columns=["input_ids", "loss_mask", "prompt_len"]).to_pylist()
        for row in table:
            ids, mask, start = row["input_ids"], row["loss_mask"], None
            for k in range(row["prompt_len"], len(ids)):
                if mask[k] == 0 and start is None:
                    start = k
                elif mask[k] == 1 and start is not None:
                    span = list(ids[start:k])
                    out.setdefault("\0".join(response.findall(str(tokenizer.decode(span)))), span)
                    start = None
    return out


def print_checks(seed: int, checks: dict[str, Any]) -> None:
    verdict = "identical" if checks["prompts_identical"] else f"DIFFER ({checks['prompts_detail']})"
    if checks["prompts_identical"] and checks["episodes_arl_dropped"]:
        verdict += f" for every episode arl recorded ({checks['episodes_arl_dropped']} dropped: the agent raised)"
    print(f"   seed {seed}: prompt token ids, TRL vs arl's shards (every step, as multisets): {verdict}")
    print(f"   seed {seed}: tool spans, TRL vs arl, for the {checks['tool_spans_shared']} tool results both produced: "
          f"{checks['tool_spans_differing']} differ; TRL supports_tool_calling={checks['supports_tool_calling']}, "
          f"TRL's episode budget {checks['max_completion_length']} tokens, TRL log {checks['trl_log']}")  # fmt: skip


# --------------------------------------------------------------------------- figures


def metric(run: Run, name: str) -> list[float]:
    return run.rewards if name == "reward" else run.info.get(name, [float("nan")] * len(run.rewards))


def report(runs: list[Run], checks: dict[int, dict[str, Any]], steps: int) -> None:
    groups = {label: sorted((r for r in runs if r.label == label), key=lambda r: r.seed) for label in LABELS}
    print_curves(groups, steps)
    figures: dict[str, Any] = {"seeds": len(groups["trl"]), "steps": steps, **print_runs(groups, steps)}
    for key in ("agent_errors", "prefix_breaks"):
        figures[f"arl-sync: {key}, total over all runs"] = int(sum(sum(r.info[key]) for r in groups["arl-sync"]))
    figures.update(check_figures(checks))
    ratios, targets = compare(groups)
    for key, value in {**figures, **ratios, **targets}.items():
        print(f"{key}: {value}")
    print("RESULT " + json.dumps({"name": "vs_trl_tools", "figures": figures, "ratios": ratios, "targets": targets,
                                  "reference": "TRL 1.16 GRPOTrainer (tool loop, tools=[calculator]), same model, "
                                               "prompts, tool schema, reward and options, run in the same session "
                                               "(times: whole process)"}))  # fmt: skip


def print_runs(groups: dict[str, list[Run]], steps: int) -> dict[str, Any]:
    """The per-run table; its figures."""
    tails = ("reward", "exact_correct", "used_tool", "turns_mean")
    print(f"\n{'run':<10}{'seed':>5}{'reward':>8}{'exact':>7}{'tool':>6}{'turns':>7}{'loop s':>8}{'process s':>10}"
          f"{'CPU s/step':>11}{'load':>6}   (reward .. turns: means over the last 20% of steps)")  # fmt: skip
    figures: dict[str, Any] = {}
    for label, each in groups.items():
        for r in each:
            t = [tail_mean(metric(r, k)) for k in tails]
            print(f"{label:<10}{r.seed:>5}{t[0]:>8.3f}{t[1]:>7.3f}{t[2]:>6.2f}{t[3]:>7.2f}{r.loop_s:>8.1f}"
                  f"{r.process_s:>10.1f}{r.cpu_s / steps:>11.2f}{r.load:>6.1f}")  # fmt: skip
        for key in tails:
            figures[f"{label}: {key}, last 20%, per seed"] = ", ".join(f"{tail_mean(metric(r, key)):.3f}" for r in each)
        figures[f"{label}: training loop s, mean"] = round(statistics.fmean(r.loop_s for r in each), 1)
        figures[f"{label}: whole process s, mean"] = round(statistics.fmean(r.process_s for r in each), 1)
        cpu = statistics.fmean(r.cpu_s for r in each) / steps
        figures[f"{label}: CPU s per step, all processes, mean"] = round(cpu, 2)
    return figures


def print_curves(groups: dict[str, list[Run]], steps: int) -> None:
    seeds = [r.seed for r in groups["trl"]]
    print("\nper step: mean reward (r) and exact-correct rate (x), mean over seeds, then each seed")
    cols = [(label, m) for label in LABELS for m in METRICS]
    short = {"trl": "trl", "arl-sync": "sync", "reward": "r", "exact_correct": "x"}
    head = "".join(f"{short[label] + ' ' + short[m]:>9}" for label, m in cols)
    print("step" + head + "  " + "".join(f"{short[label] + str(s) + short[m]:>8}" for s in seeds for label, m in cols))
    for k in range(steps):
        means = "".join(f"{statistics.fmean(metric(r, m)[k] for r in groups[label]):>9.3f}" for label, m in cols)
        each = "".join(f"{metric(groups[label][i], m)[k]:>8.3f}" for i in range(len(seeds)) for label, m in cols)
        print(f"{k:>4}" + means + "  " + each)


def check_figures(checks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    seeds = sorted(checks)
    return {
        "prompt token ids identical, TRL vs arl's shards (all seeds, all steps)": all(
            checks[s]["prompts_identical"] for s in seeds),
        "episodes arl dropped (the agent raised; TRL's prompts for them not in arl's shards), per seed": ", ".join(
            str(checks[s]["episodes_arl_dropped"]) for s in seeds),
        "tool spans compared (tool results both produced), per seed": ", ".join(
            str(checks[s]["tool_spans_shared"]) for s in seeds),
        "tool spans differing, per seed": ", ".join(str(checks[s]["tool_spans_differing"]) for s in seeds),
        "TRL supports_tool_calling (tiny model's template)": all(checks[s]["supports_tool_calling"] for s in seeds),
        "TRL replaced the chat template (not prefix-preserving)": any(
            checks[s]["chat_template_replaced_by_trl"] for s in seeds),
        "the SDK's tool schema is the agent module's CALCULATOR_TOOL": all(
            checks[s]["sdk_schema_is_CALCULATOR_TOOL"] for s in seeds),
        "TRL's episode budget (max_completion_length), tokens": checks[seeds[0]]["max_completion_length"],
    }  # fmt: skip


def compare(groups: dict[str, list[Run]]) -> tuple[dict[str, float], dict[str, str]]:
    """arl-sync - TRL paired by seed, for the reward and the exact-correct rate; the time ratios; the goal."""
    trl, sync = groups["trl"], groups["arl-sync"]
    ratios: dict[str, float] = {}
    intervals = {}
    print()
    for m in METRICS:
        for part, summary in (("all steps", statistics.fmean), ("last 20%", tail_mean)):
            diff, ci = paired([summary(metric(r, m)) for r in sync], [summary(metric(r, m)) for r in trl])
            intervals[(m, part)] = (diff, ci)
            ratios[f"arl-sync - TRL {m}, {part}, paired mean"] = diff
            ratios[f"arl-sync - TRL {m}, {part}, 95% half-width"] = ci
            print(f"arl-sync - TRL, paired by seed: {m} over {part} {diff:+.3f} (95% interval +-{ci:.3f})")
    for kind in ("process_s", "loop_s"):
        name = "whole process" if kind == "process_s" else "training loop"
        ratios[f"TRL / arl-sync {name} time"] = statistics.fmean(getattr(r, kind) for r in trl) / statistics.fmean(
            getattr(r, kind) for r in sync)  # fmt: skip
    ratios["arl-sync / TRL CPU seconds, all processes"] = statistics.fmean(r.cpu_s for r in sync) / statistics.fmean(
        r.cpu_s for r in trl)  # fmt: skip
    same = all(abs(d) <= ci for (m, _), (d, ci) in intervals.items() if m == "reward")
    (d_all, c_all), (d_tail, c_tail) = intervals[("reward", "all steps")], intervals[("reward", "last 20%")]
    goal = "arl-sync reward per step within noise of TRL (paired over seeds, 95%)"
    verdict = "not judged (one seed: no interval)" if len(sync) < 2 else "met" if same else "missed"
    targets = {goal: verdict + f" (all steps {d_all:+.3f} +-{c_all:.3f}; last 20% {d_tail:+.3f} +-{c_tail:.3f})"}
    return ratios, targets


if __name__ == "__main__":
    sys.exit(main())
