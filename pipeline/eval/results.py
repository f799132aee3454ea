"""Reading evaluation results back: `metrics/eval.jsonl` holds one line per (version, set) evaluation, appended
(a later line for the same version and set is a newer evaluation and wins)."""

from __future__ import annotations

import json
from typing import Any

from pipeline.paths import RunPaths


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
        figures += [f"{key} {_fmt(value)}" for key, value in sorted(record.items())
                    if key.startswith(("pass@", "agent/"))]  # fmt: skip
        size = f"{record.get('prompts', '?')} prompts x {record.get('num_samples', '?')}"
        lines.append(f"  version {record['version']:<5} {record['set']:<16} " + " · ".join(figures) + f"  ({size})")
    return lines


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "n/a"
