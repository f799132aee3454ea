"""Sample-level advantages from rewards, normalised within GRPO groups (`group_id`).

Every estimator returns one scalar per sample; the loss broadcasts it over the sample's sampled
tokens. Groups of one sample carry no relative signal and get advantage 0 under every estimator.

- `grpo`:   A_i = (r_i - mean_g) / (std_g + eps), std with Bessel's correction (as DeepSeekMath/TRL).
- `drgrpo`: A_i = r_i - mean_g (Dr. GRPO: the std division biases toward easy/hard groups).
- `rloo`:   A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean_g) (leave-one-out baseline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

Estimator = Literal["grpo", "drgrpo", "rloo"]


def compute_advantages(
    rewards: Sequence[float], group_ids: Sequence[str], method: Estimator = "grpo", eps: float = 1e-6
) -> np.ndarray:
    """Advantages (float64, one per sample, in input order) for `rewards` grouped by `group_ids`."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    if method not in ("grpo", "drgrpo", "rloo"):
        raise ValueError(f"unknown advantage estimator {method!r}; valid: grpo, drgrpo, rloo")
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for members in groups.values():
        idx = np.asarray(members)
        n = len(idx)
        if n < 2:
            continue  # no baseline from a single sample: zero advantage, not r - r = noise
        centred = r[idx] - r[idx].mean()
        if method == "grpo":
            out[idx] = centred / (r[idx].std(ddof=1) + eps)
        elif method == "drgrpo":
            out[idx] = centred
        else:
            out[idx] = centred * n / (n - 1)
    return out


def normalize_per_task(advantages: np.ndarray, tasks: Sequence[str], eps: float = 1e-6) -> np.ndarray:
    """Each task's advantages divided by their standard deviation (population, over the step's samples of that
    task); a task whose advantages are all zero (or all equal) is left as it is."""
    if len(advantages) != len(tasks):
        raise ValueError(f"{len(advantages)} advantages but {len(tasks)} tasks")
    out = np.array(advantages, dtype=np.float64)
    names = np.asarray(tasks)
    for task in sorted(set(tasks)):
        idx = names == task
        std = out[idx].std()
        if std > eps:
            out[idx] /= std
    return out
