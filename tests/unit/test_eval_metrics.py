"""pass@k against values computed by hand from the binomial formula, and a set's summary of its runs."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.eval.scores import RunResult, pass_at_k, summarize
from pipeline.run.config import validate_config
from schemas.config import EvalSetConfig


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (4, 1, 1, 0.25),  # one success in four: a single draw finds it a quarter of the time
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
    (3, 2, 2, 1.0),  # fewer failures than draws: a success is certain
])  # fmt: skip
def test_pass_at_k_matches_the_binomial_formula(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_stays_exact_where_binomials_would_overflow_a_float() -> None:
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


def test_pass_at_k_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_a_summary_scores_prompts_not_runs_and_counts_failures_as_misses() -> None:
    runs = [
        RunResult(0, 1.0, {"exact_correct": 1.0}), RunResult(0, 0.2, {"exact_correct": 0.0}),  # one of two
        RunResult(1, 0.4, {"exact_correct": 0.0}), RunResult(1, None, {}, "timed out"),  # none of two
    ]  # fmt: skip
    by_metric = summarize(runs, ks=[1, 2], success_metric="exact_correct", success_reward=1.0)
    assert by_metric["prompts"] == 2 and by_metric["runs"] == 4 and by_metric["failed_runs"] == 1
    assert by_metric["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert by_metric["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert by_metric["reward_mean"] == pytest.approx((1.0 + 0.2 + 0.4) / 3), "failed runs have no reward"
    assert by_metric["agent/exact_correct"] == pytest.approx(1 / 3)
    by_reward = summarize(runs, ks=[1], success_metric=None, success_reward=0.4)
    assert by_reward["pass@1"] == pytest.approx((0.5 + 0.5) / 2), "reward >= 0.4: 1.0 and 0.4 succeed, one per prompt"


def test_eval_sets_check_k_and_names_and_default_to_greedy_for_one_sample() -> None:
    one = EvalSetConfig(name="a", path="x.jsonl")
    assert one.ks() == [1] and one.effective_temperature(0.7) == 0.0
    many = EvalSetConfig(name="b", path="x.jsonl", num_samples=8)
    assert many.ks() == [1, 8] and many.effective_temperature(0.7) == 0.7
    with pytest.raises(ConfigError, match=r"pass_at \[9\] needs k between 1 and num_samples \(8\)"):
        validate_config({"eval": {"sets": [{"name": "b", "path": "x.jsonl", "num_samples": 8, "pass_at": [9]}]}})
    with pytest.raises(ConfigError, match=r"the names \['a'\] are used twice"):
        validate_config({"eval": {"sets": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}})


def test_the_newest_line_of_each_version_and_set_wins_and_a_cut_line_is_skipped(tmp_path: Path) -> None:
    from pipeline.eval.results import evaluation_lines, latest_evaluations
    from pipeline.run.paths import RunPaths

    paths = RunPaths(tmp_path)
    paths.eval_metrics.parent.mkdir(parents=True)
    lines = [
        {"version": 4, "set": "b", "reward_mean": 0.5, "pass@1": 0.25, "prompts": 8, "num_samples": 1},
        {"version": 2, "set": "a", "reward_mean": 0.1, "pass@1": 0.0},
        {"version": 4, "set": "b", "reward_mean": 0.75, "pass@1": 0.5, "prompts": 8, "num_samples": 1},
    ]
    paths.eval_metrics.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"version": 9, "se')
    newest = [(r["version"], r["set"], r["reward_mean"]) for r in latest_evaluations(paths)]
    assert newest == [(2, "a", 0.1), (4, "b", 0.75)]
    shown = evaluation_lines(paths)
    assert shown[-1].split() == ["version", "4", "b", "reward", "0.750", "·", "pass@1", "0.500", "(8", "prompts",
                                 "x", "1)"]  # fmt: skip
