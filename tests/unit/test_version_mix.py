"""Per-token staleness metrics of a step whose samples mix weight versions (partial rollouts)."""

from __future__ import annotations

import numpy as np

from pipeline.trainer.data import Sample, StepData
from pipeline.trainer.metrics import version_mix


def sample(versions: list[int], mask: list[int]) -> Sample:
    n = len(versions)
    return Sample("s", "g", np.arange(n), np.array(mask, dtype=np.int8), np.zeros(n, dtype=np.float32),
                  np.array(versions, dtype=np.int32), 1.0)  # fmt: skip


def test_tokens_count_by_their_own_version() -> None:
    mixed = sample([-1, -1, 3, 3, 4, 4], [0, 0, 1, 1, 1, 1])  # paused across the 3 -> 4 update
    plain = sample([-1, 4, 4], [0, 1, 1])
    data = StepData(5, [mixed, plain], staleness=[2, 1])
    mix = version_mix(data)
    assert mix["mixed_version_samples"] == 1
    assert mix["token_staleness_mean"] == (2 + 2 + 1 + 1 + 1 + 1) / 6  # the prompt's -1 is not counted


def test_an_empty_step_reports_zeros() -> None:
    assert version_mix(StepData(1, [])) == {"token_staleness_mean": 0.0, "mixed_version_samples": 0}
