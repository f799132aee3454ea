"""What an evaluation reports for one set: mean reward, pass@k, and the means of the agent's own metrics.

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code"):
with n runs of a prompt of which c succeeded, the chance that k runs drawn without replacement from those n
hold at least one success is 1 - C(n-c, k) / C(n, k); the set's pass@k is its mean over prompts. It is
computed as a product (1 - k/i for i in n-c+1..n), which stays exact where the binomials would overflow.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunResult:
    """One evaluation run: its prompt, reward (None: failed or rejected) and the agent's metrics."""

    prompt: int
    """Index of the prompt in the set."""
    reward: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n runs with c successes (module docstring)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def succeeded(run: RunResult, success_metric: str | None, success_reward: float) -> bool:
    if run.reward is None:
        return False
    if success_metric is not None:
        return bool(run.metrics.get(success_metric, 0.0))
    return run.reward >= success_reward


def summarize(
    runs: list[RunResult], *, ks: list[int], success_metric: str | None, success_reward: float
) -> dict[str, Any]:
    """The set's figures: prompts, runs, failed runs, reward mean, pass@k for each k, and `agent/<name>` means.

    A failed run (an error, a timeout, a rejection) counts as a run without success and without reward."""
    by_prompt: dict[int, list[RunResult]] = {}
    for run in runs:
        by_prompt.setdefault(run.prompt, []).append(run)
    rewards = [r.reward for r in runs if r.reward is not None]
    out: dict[str, Any] = {
        "prompts": len(by_prompt),
        "runs": len(runs),
        "failed_runs": sum(r.reward is None for r in runs),
        "reward_mean": statistics.fmean(rewards) if rewards else None,
    }
    for k in ks:
        estimates = [
            pass_at_k(len(group), sum(succeeded(r, success_metric, success_reward) for r in group), k)
            for group in by_prompt.values()
            if len(group) >= k
        ]
        out[f"pass@{k}"] = statistics.fmean(estimates) if estimates else None
    names = sorted({name for r in runs for name in r.metrics})
    for name in names:
        values = [r.metrics[name] for r in runs if name in r.metrics]
        out[f"agent/{name}"] = statistics.fmean(values)
    return out
