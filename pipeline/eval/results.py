"""Evaluation results, written and read back. An evaluation of (version, set) is recorded in two places, in
this order: its rows as shards in `eval/step_<version>/<set>/` (published atomically; the manifest's `extra`
holds the figures), then one line in `metrics/eval.jsonl` (appended; a later line for the same version and set
is a newer evaluation and wins). The shards are the record of completion: a writer killed between the two
leaves shards without a line, and `restore_lines` writes the line from the manifest.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from pipeline.run.paths import MANIFEST, RunPaths
from schemas.manifest import Manifest

if TYPE_CHECKING:
    from pipeline.eval.runner import SetResult
    from pipeline.run.sinks import MetricsSink
    from schemas.config import ArlConfig

log = logging.getLogger("arl.eval")
EVAL_STAGE = "eval"
"""Logs go to `logs/eval/`; TensorBoard to `metrics/tb/eval`; W&B to the run's `eval` run."""


def record(paths: RunPaths, config: ArlConfig, result: SetResult, weights: str) -> None:
    """The set's shards (replacing an earlier evaluation of the same version and set), then its metrics line."""
    from pipeline.agents.episode import sort_key
    from pipeline.run.shards import write_step
    from pipeline.run.sinks import JsonlSink

    tokenizer = config.model.tokenizer or config.model.path
    rows = sorted(result.rows, key=sort_key)
    extra = {**result.figures, "weights": weights}
    write_step(
        paths,
        result.version,
        rows,
        producer="eval",
        tokenizer=tokenizer,
        extra=extra,
        dest=paths.eval_dir(result.version, result.name),
    )
    # `step` (the JSONL sinks' key) is the version: one line per (version, set), a later evaluation after it.
    JsonlSink(paths.eval_metrics).log(result.version, metrics_line(result.version, result.name, extra))


def sink_figures(result: SetResult) -> dict[str, Any]:
    """The set's figures as TensorBoard/W&B series (`<set>/<figure>`, logged at the version)."""
    return {f"{result.name}/{k}": v for k, v in result.figures.items()}


def metrics_line(version: int, name: str, figures: dict[str, Any]) -> dict[str, Any]:
    return {"version": version, "set": name, **figures}


def is_recorded(paths: RunPaths, version: int, name: str) -> bool:
    """Whether (version, set) has complete shards (the record of completion, module docstring)."""
    return (paths.eval_dir(version, name) / MANIFEST).is_file()


def restore_lines(paths: RunPaths, config: ArlConfig, versions: list[int]) -> int:
    """Append the missing `eval.jsonl` line of every (version, set) whose shards are complete; how many."""
    from pipeline.run.sinks import JsonlSink

    have = {(int(r["version"]), str(r["set"])) for r in latest_evaluations(paths)}
    restored = 0
    for version in versions:
        for spec in config.eval.sets:
            if (version, spec.name) in have or not is_recorded(paths, version, spec.name):
                continue
            manifest = Manifest.model_validate_json((paths.eval_dir(version, spec.name) / MANIFEST).read_bytes())
            JsonlSink(paths.eval_metrics).log(version, metrics_line(version, spec.name, dict(manifest.extra)))
            log.info("evaluation of version %d on %s: its metrics line restored from its shards", version, spec.name)
            restored += 1
    return restored


def open_sinks(paths: RunPaths, config: ArlConfig) -> MetricsSink:
    """TensorBoard (`metrics/tb/eval`, series `eval/<set>/<figure>` by weight version) and the run's W&B `eval`
    run when `metrics.wandb` is set. W&B keeps one step order per run: an evaluation of a version below one it
    already holds is dropped there (the JSONL line and TensorBoard keep it)."""
    from pipeline.run.sinks import MultiSink, TensorBoardSink, open_wandb

    wandb = open_wandb(config, paths, EVAL_STAGE, prefix="eval")
    try:
        return MultiSink(TensorBoardSink(paths.tensorboard / EVAL_STAGE, "eval"), wandb)
    except ImportError:  # tensorboard is optional; eval.jsonl is the record
        return MultiSink(wandb)


def latest_evaluations(paths: RunPaths) -> list[dict[str, Any]]:
    """The newest line of every (version, set), ordered by version then set; lines cut by `kill -9` skipped."""
    if not paths.eval_metrics.exists():
        return []
    newest: dict[tuple[int, str], dict[str, Any]] = {}
    for line in paths.eval_metrics.read_text().splitlines():
        try:
            record = json.loads(line)
            newest[(int(record["version"]), str(record["set"]))] = record
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return [newest[key] for key in sorted(newest)]


def evaluation_lines(paths: RunPaths, *, last: int = 6) -> list[str]:
    """The newest evaluations for people (`arl status`): version, set, reward, pass@k, the agent's metrics."""
    lines = []
    for record in latest_evaluations(paths)[-last:]:
        figures = [f"reward {_fmt(record.get('reward_mean'))}"]
        figures += [
            f"{key} {_fmt(value)}" for key, value in sorted(record.items()) if key.startswith(("pass@", "agent/"))
        ]
        size = f"{record.get('prompts', '?')} prompts x {record.get('num_samples', '?')}"
        lines.append(f"  version {record['version']:<5} {record['set']:<16} " + " · ".join(figures) + f"  ({size})")
    return lines


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "n/a"
