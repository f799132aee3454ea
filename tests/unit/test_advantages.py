"""Advantage estimators on worked examples (numbers computed by hand in the comments)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.trainer.advantages import compute_advantages, normalize_per_task

REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 5.0]
GROUPS = ["a", "a", "a", "a", "b", "b"]


def test_grpo_normalises_by_group_mean_and_sample_std() -> None:
    # group a: mean 0.5, sample std sqrt(1/3) = 0.57735 -> +-0.86603; group b: mean 3.5, std 2.12132 -> -+0.70711
    adv = compute_advantages(REWARDS, GROUPS, "grpo", eps=0.0)
    np.testing.assert_allclose(adv, [0.866025, -0.866025, -0.866025, 0.866025, -0.707107, 0.707107], atol=1e-6)


def test_drgrpo_only_subtracts_the_group_mean() -> None:
    adv = compute_advantages(REWARDS, GROUPS, "drgrpo")
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, -1.5, 1.5])


def test_rloo_uses_the_mean_of_the_others() -> None:
    # sample 0: 1 - mean(0, 0, 1) = 2/3; sample 1: 0 - mean(1, 0, 1) = -2/3; group b: 2 - 5 = -3, 5 - 2 = 3
    adv = compute_advantages(REWARDS, GROUPS, "rloo")
    np.testing.assert_allclose(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -3.0, 3.0])


@pytest.mark.parametrize("method", ["grpo", "drgrpo", "rloo"])
def test_constant_and_singleton_groups_get_zero(method: str) -> None:
    adv = compute_advantages([3.0, 3.0, 3.0, 7.0], ["a", "a", "a", "solo"], method)  # type: ignore[arg-type]
    np.testing.assert_array_equal(adv, [0.0, 0.0, 0.0, 0.0])


def test_order_of_samples_does_not_matter() -> None:
    perm = [5, 2, 0, 4, 1, 3]
    adv = compute_advantages(REWARDS, GROUPS, "grpo")
    shuffled = compute_advantages([REWARDS[i] for i in perm], [GROUPS[i] for i in perm], "grpo")
    np.testing.assert_allclose(shuffled, adv[perm])


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="2 rewards but 1 group"):
        compute_advantages([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages([1.0], ["a"], "ppo")  # type: ignore[arg-type]


def test_per_task_normalisation_by_hand() -> None:
    # drgrpo advantages of two tasks on different reward scales: task a in {-10, 10}, task b in {-1, 1}
    advantages = compute_advantages([0.0, 20.0, 0.0, 2.0], ["a", "a", "b", "b"], "drgrpo")
    np.testing.assert_allclose(advantages, [-10.0, 10.0, -1.0, 1.0])
    scaled = normalize_per_task(advantages, ["big", "big", "small", "small"])
    np.testing.assert_allclose(scaled, [-1.0, 1.0, -1.0, 1.0])  # each task's std (10 and 1) divided out
    constant = normalize_per_task(np.array([0.0, 0.0, 3.0, -3.0]), ["flat", "flat", "b", "b"])
    np.testing.assert_allclose(constant, [0.0, 0.0, 1.0, -1.0]), "a task without spread is left alone"
    with pytest.raises(ValueError, match="4 advantages but 3 tasks"):
        normalize_per_task(advantages, ["a", "a", "b"])
