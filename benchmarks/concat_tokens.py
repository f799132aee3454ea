"""Concat vs individual export: training tokens and trainer throughput on the same 8-turn sessions.

Sessions: `--sessions` runs of an 8-turn tool-using agent (`benchmarks/_multiturn_sessions.py`: the
calculator agent of `examples/agents/tool_agent.py` with a fixed budget of 8 model calls, plain
OpenAI SDK) through the real proxy and a real `hf` engine serving the tiny model
(`pipeline.demo.tiny_model.make_tiny_model`); every session is exported both ways from the same recorded
tokens (`export_style: concat`, one row per run, and `individual`, one row per LLM call).

Trainer: each style's rows are written as a trajectory step (`pipeline.run.shards.write_step`) and read
back as the trainer reads them (`pipeline.trainer.data.load_step`), packed by
`pipeline.trainer.packing.plan_step` into micro-batches of the config's `trainer.micro_batch_tokens`
in the backend's layout (`trainer.packing: auto`: right-padded rows on CPU, where sdpa would compute
a packed row's whole T×T), and fed to the real `TorchBackend` (CPU, fp32):

* correctness, on the initial weights (those the engine sampled with): the log-probability of every
  sampled token (loss_mask 1) from the concat rows against the same token's from the individual
  rows, and both against the engine-recorded behaviour log-probs;
* throughput: one optimizer update over all rows of a style (`train_minibatch`: forward, the
  policy loss, backward, grad clip, AdamW step), best of `--repeats` after a warm-up, the styles
  alternating, in wall and in CPU seconds (the steadier figure on a shared machine); tokens/s
  (wall) counts every real token of the rows (what the trainer computes over), sampled tokens/s only
  the trained ones (the same tokens in both styles).

Usage: `python benchmarks/concat_tokens.py [--sessions 8] [--turns 8] [--max-tokens 24] [--packing auto]`.
Prints the figures, then one `RESULT {...}` line for `arl bench`. Targets: concat tokens per
trajectory <= 1/4 of individual's for 8 turns; max |Δ| log-prob between the styles <= 1e-4.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as `python benchmarks/concat_tokens.py`: the root, for `benchmarks.` imports
from benchmarks._multiturn_sessions import SessionExport, collect_sessions  # noqa: E402

STYLES = ("concat", "individual")
TOKEN_RATIO_TARGET = 0.25
LOGPROB_TOLERANCE = 1e-4  # fp32 on CPU: the same causal prefix scored in rows of different lengths


def token_figures(sessions: list[SessionExport]) -> dict[str, float]:
    """Per-trajectory (per agent run) means of the rows and tokens each style hands the trainer."""
    n = len(sessions)

    def mean(values: list[int]) -> float:
        return round(sum(values) / n, 1)

    figures: dict[str, float] = {}
    for style in STYLES:
        rows = [getattr(s, style) for s in sessions]
        figures[f"{style}_rows_per_traj"] = mean([len(r) for r in rows])
        figures[f"{style}_tokens_per_traj"] = mean([sum(len(row.input_ids) for row in r) for r in rows])
    figures["sampled_tokens_per_traj"] = mean([sum(sum(row.loss_mask) for row in s.concat) for s in sessions])
    figures["first_prompt_tokens"] = mean([s.individual[0].prompt_len for s in sessions])
    figures["turns_per_traj"] = mean([s.num_interactions for s in sessions])
    figures["prefix_breaks"] = sum(s.prefix_breaks for s in sessions)
    return figures


def make_backend(model_dir: str | Path, budget: int | None, packing: str = "auto") -> tuple[Any, Any]:
    """The trainer's `TorchBackend` on CPU with the run's defaults (temperature 1: the agent's), loaded."""
    from pipeline.run.config import load_config
    from pipeline.trainer.torch_backend import TorchBackend

    overrides = [f"model.path={model_dir}", "trainer.device=cpu", "rollout.temperature=1.0",
                 f"trainer.packing={packing}"]  # fmt: skip
    if budget is not None:
        overrides.append(f"trainer.micro_batch_tokens={budget}")
    config = load_config(None, overrides)
    backend = TorchBackend(config, total_updates=1000)
    backend.load(Path(model_dir), None)
    return backend, config


def load_as_trainer(rows: list[Any], run_dir: Path, model_dir: str | Path) -> list[Any]:
    """Write `rows` as step 0 of a run and read them back through the trainer's loader (`Sample`s)."""
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import write_step
    from pipeline.trainer.data import load_step

    paths = RunPaths(run_dir)
    write_step(paths, 0, [row.at_step(0) for row in rows], producer="rollout", tokenizer=str(model_dir))
    return load_step(paths, 0, max_staleness=0).samples


def plan(samples: list[Any], config: Any, layout: str) -> list[Any]:
    """The step's micro-batches, as the trainer plans them (one minibatch, the backend's layout)."""
    from pipeline.trainer.advantages import compute_advantages
    from pipeline.trainer.packing import plan_step

    cfg = config.trainer
    advantages = compute_advantages([s.reward for s in samples], [s.group_id for s in samples],
                                    cfg.algorithm.advantage)  # fmt: skip
    (micro_batches,) = plan_step(samples, advantages, minibatches=1, budget=cfg.micro_batch_tokens,
                                 agg=cfg.algorithm.loss_agg, seed=cfg.seed, step=0, layout=layout)  # fmt: skip
    return micro_batches


def token_logprobs(backend: Any, samples: list[Any], micro_batches: list[Any]) -> dict[str, np.ndarray]:
    """Per sample id: the trainer's log-prob of each token of the row (index p = token p; NaN at 0)."""
    out: dict[str, np.ndarray] = {}
    for micro in micro_batches:
        logp = backend.logprobs(micro).numpy()
        rows, width = micro.input_ids.shape  # one packed row, or right-padded rows flattened one after the other
        starts = np.cumsum([0, *micro.lengths[:-1]]) if rows == 1 else np.arange(rows) * width
        for index, start, length in zip(micro.sample_index, starts, micro.lengths, strict=True):
            # position j predicts token j + 1 (packing.py), so token p's log-prob sits at p - 1
            out[samples[index].sample_id] = np.concatenate([[np.nan], logp[start : start + length - 1]])
    return out


def compare_logprobs(sessions: list[SessionExport], logps: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Match every sampled token of the individual rows to the same token of the concat rows; max |Δ| log-prob.

    An individual row is its call's whole prompt plus its sampled tokens, which is a prefix of the
    concat row that holds the call; its loss mask covers only that call's tokens, so each sampled
    token is compared once. Raises if the rows disagree on tokens, masks or engine log-probs.
    """
    worst = {"concat_vs_individual": 0.0, "concat_vs_engine": 0.0, "individual_vs_engine": 0.0}
    compared = 0
    for s in sessions:
        holder = {i: row for row in s.concat for i in json.loads(row.metadata)["interaction_ids"]}
        for row in s.individual:
            whole = holder[row.sample_id]
            n, where = len(row.input_ids), f"session {s.session_id}, call {row.sample_id}"
            mask = np.asarray(row.loss_mask, dtype=bool)
            if list(whole.input_ids[:n]) != list(row.input_ids):
                raise AssertionError(f"{where}: the individual row is not a prefix of its concat row")
            if not np.asarray(whole.loss_mask[:n], dtype=bool)[mask].all():
                raise AssertionError(f"{where}: sampled tokens the concat row does not train")
            engine = np.asarray(row.logprobs, dtype=np.float64)[mask]
            if not np.array_equal(engine, np.asarray(whole.logprobs[:n], dtype=np.float64)[mask]):
                raise AssertionError(f"{where}: the two rows carry different behaviour log-probs")
            from_individual = logps["individual"][row.sample_id][mask]
            from_concat = logps["concat"][whole.sample_id][:n][mask]
            for key, a, b in (("concat_vs_individual", from_concat, from_individual),
                              ("concat_vs_engine", from_concat, engine),
                              ("individual_vs_engine", from_individual, engine)):  # fmt: skip
                worst[key] = max(worst[key], float(np.abs(a - b).max()))
            compared += int(mask.sum())
    in_concat = sum(sum(row.loss_mask) for s in sessions for row in s.concat)
    if compared != in_concat:
        raise AssertionError(f"{in_concat} sampled tokens in the concat rows, {compared} in the individual rows")
    return {"sampled_tokens_compared": compared, **{f"max_abs_dlogp_{k}": v for k, v in worst.items()}}


def logprob_agreement(sessions: list[SessionExport], model_dir: str | Path, workdir: Path, budget: int | None = None,
                      packing: str = "auto") -> tuple[dict[str, Any], Any, Any, dict[str, list[Any]]]:  # fmt: skip
    """Load both styles as the trainer does, score them on the initial weights, compare token by token.

    Returns (the comparison, the backend, its config, the micro-batches of each style).
    """
    backend, config = make_backend(model_dir, budget, packing)
    plans: dict[str, list[Any]] = {}
    logps: dict[str, dict[str, np.ndarray]] = {}
    for style in STYLES:
        rows = [row for s in sessions for row in getattr(s, style)]
        samples = load_as_trainer(rows, workdir / f"{style}-{packing}", model_dir)
        plans[style] = plan(samples, config, backend.layout)
        logps[style] = token_logprobs(backend, samples, plans[style])
    return compare_logprobs(sessions, logps), backend, config, plans


def time_updates(backend: Any, config: Any, plans: dict[str, list[Any]],
                 repeats: int) -> dict[str, tuple[float, float]]:  # fmt: skip
    """(wall, CPU) seconds of one optimizer update over each style's micro-batches, each the best of `repeats`
    after a warm-up. CPU seconds (this process, all threads) change less than wall time on a shared machine."""
    from pipeline.trainer.losses import policy_loss

    algo = config.trainer.algorithm

    def loss_fn(logp: Any, entropy: Any, batch: Any) -> Any:
        if algo.decoupled:  # one minibatch: the update's own forward gives the proximal log-probs (trainer loop)
            batch = dataclasses.replace(batch, prox_logp=logp.detach() * batch.mask)
        return policy_loss(logp, entropy, batch, algo)

    best = {style: (float("inf"), float("inf")) for style in plans}
    for rep in range(repeats + 1):
        for style, micro_batches in plans.items():
            wall, cpu = time.perf_counter(), time.process_time()
            backend.train_minibatch(micro_batches, loss_fn)
            if rep > 0:
                took = (time.perf_counter() - wall, time.process_time() - cpu)
                best[style] = (min(best[style][0], took[0]), min(best[style][1], took[1]))
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.demo.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="arl-concat-") as tmp:
        work = Path(tmp)
        model_dir = args.model or make_tiny_model(work / "model")
        t0 = time.perf_counter()
        sessions = asyncio.run(collect_sessions(model_dir, sessions=args.sessions, turns=args.turns,
                                                max_tokens=args.max_tokens, seed=args.seed))  # fmt: skip
        rollout_s = time.perf_counter() - t0
        figures: dict[str, Any] = token_figures(sessions)
        agreement, backend, config, plans = logprob_agreement(sessions, model_dir, work, args.budget, args.packing)
        seconds = time_updates(backend, config, plans, args.repeats)
    figures.update({"sessions": len(sessions), "rollout_s": round(rollout_s, 1), "layout": backend.layout,
                    "micro_batch_tokens": config.trainer.micro_batch_tokens})  # fmt: skip
    sampled = agreement["sampled_tokens_compared"]  # every sampled token, once (checked in both styles)
    for style in STYLES:
        tokens = sum(sum(m.lengths) for m in plans[style])  # real tokens (no padding)
        figures[f"{style}_micro_batches"] = len(plans[style])
        wall, cpu = seconds[style]
        figures[f"{style}_update_s"] = round(wall, 3)
        figures[f"{style}_update_cpu_s"] = round(cpu, 3)
        figures[f"{style}_train_tok_s"] = round(tokens / wall, 1)
        figures[f"{style}_sampled_tok_s"] = round(sampled / wall, 1)
    # as text: RESULTS.md prints floats with 3 decimals, which would show these as 0.000
    figures.update({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in agreement.items()})
    ratio = total_tokens(sessions, "concat") / total_tokens(sessions, "individual")
    speedup = seconds["individual"][0] / seconds["concat"][0]
    cpu_speedup = seconds["individual"][1] / seconds["concat"][1]
    delta = float(agreement["max_abs_dlogp_concat_vs_individual"])
    return {"name": "concat_tokens", "figures": figures,
            "ratios": {"concat_vs_individual_tokens": round(ratio, 3), "update_speedup_concat": round(speedup, 2),
                       "update_cpu_speedup_concat": round(cpu_speedup, 2)},
            "reference": f"export_style individual on the same {len(sessions)} {args.turns}-turn sessions "
                         "(same recorded tokens, same trainer, same weights)",
            "targets": {f"concat_vs_individual_tokens <= {TOKEN_RATIO_TARGET}":
                        "met" if ratio <= TOKEN_RATIO_TARGET else f"missed ({ratio:.3f})",
                        f"max_abs_dlogp_concat_vs_individual <= {LOGPROB_TOLERANCE:g}":
                        "met" if delta <= LOGPROB_TOLERANCE else f"missed ({delta:.3g})"}}  # fmt: skip


def total_tokens(sessions: list[SessionExport], style: str) -> int:
    return sum(len(row.input_ids) for s in sessions for row in getattr(s, style))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=8, help="agent runs (groups of 4 on one question)")
    parser.add_argument("--turns", type=int, default=8, help="model calls per run")
    parser.add_argument("--max-tokens", type=int, default=24, help="max_tokens of each call")
    parser.add_argument("--budget", type=int, default=None, help="trainer.micro_batch_tokens (default: the config's)")
    parser.add_argument("--packing", default="auto", choices=["auto", "packed", "padded"], help="trainer.packing")
    parser.add_argument("--repeats", type=int, default=2, help="timed updates per style (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    parser.add_argument("--model", default=None, help="a model dir (default: a fresh tiny model)")
    result = run(parser.parse_args())
    for key, value in {**result["figures"], **result["ratios"]}.items():
        print(f"{key:>40}: {value}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
