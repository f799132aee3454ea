"""When do two runs' per-step curves part ways? The test `arl diff` applies to every curve.

Two runs of one config with different seeds never give equal curves: each step's reward mean is a
noisy estimate, so "the curves differ" means nothing until the difference is larger than that noise.
The rule (docs/inspect.md, "Comparing runs: arl diff"):

1. **Noise of a run** is its step-to-step variability: sigma = MAD(diff(x)) × 1.4826 / √2. First
   differences cancel the slow trend a learning curve has (so learning is not mistaken for noise),
   the /√2 turns the spread of a difference back into the spread of one step, and the median
   absolute deviation ignores the few jumps a run has (a crash, a restart).
2. **Windows**: over the steps both runs logged, a trailing window of `window` steps ending at t; the
   difference of the two windows' means, d_t, has standard error se = sqrt(sa²/w + sb²/w) when the
   steps' noise is independent (each step samples fresh rollouts).
3. **Divergence**: |d_t| > `sigmas` × se in `consecutive` windows in a row, all with the same sign.
   The reported step is the last step of the first window of that streak: the first step at which
   the difference is established, which can trail the real split by up to `window` steps (the
   window's start is reported too). One window over the threshold is not enough: overlapping
   windows share their steps, so one unlucky stretch crosses it several times. Measured on 150-step
   synthetic curves (a saturating trend plus normal noise, tests/unit/test_divergence.py): two
   runs of the same curve were called diverged in 0.04% of 5,000 seed pairs with the defaults
   (1.8% with 5 windows instead of 10), and a shift of 2 per-step sigmas at step 60 was found in
   every one of 300 pairs, at step 66 in the median (63-79 for 90% of them).

What it does not do: correct for testing many curves, or for noise that is correlated across steps
(a run whose reward oscillates slowly looks calmer to rule 1 than it is); both make it too eager,
so read a divergence of a noisy curve near the end of a run with care.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAD_TO_SIGMA = 1.4826
"""MAD × this = standard deviation, for normal noise."""


@dataclass(frozen=True)
class NoiseRule:
    window: int = 10
    """Steps in each trailing window whose means are compared."""
    sigmas: float = 3.0
    """How many standard errors the difference of the windows' means must exceed."""
    consecutive: int = 10
    """Windows in a row that must exceed it (same sign) before the curves count as diverged."""

    def check(self) -> None:
        if self.window < 2 or self.consecutive < 1 or not self.sigmas > 0:
            raise ValueError(f"need window >= 2, consecutive >= 1, sigmas > 0; got {self}")

    @property
    def min_steps(self) -> int:
        """Common steps needed before anything can be said."""
        return self.window + self.consecutive - 1


@dataclass(frozen=True)
class Divergence:
    step: int
    """The last step of the first window of the streak (the difference is established here)."""
    window_start: int
    """The first step of that window: the split is somewhere in [window_start, step]."""
    diff: float
    """Mean of b minus mean of a over that window."""
    se: float
    """Its standard error (from the two runs' own step-to-step noise)."""

    @property
    def z(self) -> float:
        return self.diff / self.se if self.se > 0 else float("inf")


def step_noise(values: np.ndarray) -> float:
    """A run's per-step noise (rule 1); 0.0 for fewer than 3 values or a constant curve."""
    values = np.asarray(values, dtype=float)
    if values.size < 3:
        return 0.0
    diffs = np.diff(values)
    return float(MAD_TO_SIGMA * np.median(np.abs(diffs - np.median(diffs))) / np.sqrt(2.0))


def first_divergence(steps: np.ndarray, a: np.ndarray, b: np.ndarray, rule: NoiseRule) -> Divergence | None:
    """The first step where b departs from a beyond noise (rules 2-3), over steps both have, in order.

    `steps`, `a`, `b` are aligned (same length, the common steps, increasing). None when the curves
    never diverge or there are fewer than `rule.min_steps` common steps."""
    rule.check()
    steps, a, b = np.asarray(steps), np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if steps.size < rule.min_steps:
        return None
    w = rule.window
    kernel = np.ones(w) / w
    diffs = np.convolve(b, kernel, mode="valid") - np.convolve(a, kernel, mode="valid")  # window ending at i+w-1
    se = float(np.sqrt(step_noise(a) ** 2 / w + step_noise(b) ** 2 / w))
    # A floor for two noiseless curves (a constant lr): float rounding alone must not count as divergence.
    floor = 1e-9 * max(1.0, float(np.max(np.abs(np.concatenate([a, b])))))
    beyond = np.abs(diffs) > max(rule.sigmas * se, floor)
    sign = np.sign(diffs)
    streak = 0
    for i in range(len(diffs)):
        same_sign = streak > 0 and sign[i] == sign[i - 1]
        streak = (streak + 1 if same_sign else 1) if beyond[i] else 0
        if streak == rule.consecutive:
            first = i - rule.consecutive + 1
            return Divergence(int(steps[first + w - 1]), int(steps[first]), float(diffs[first]), se)
    return None
