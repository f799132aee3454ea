"""In-run evaluation's schedule and bookkeeping: which versions are due, the session slots kept for it, the
trainer's hold on the next publication, and a metrics line restored (once) from the shards a kill left."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import ConfigError
from pipeline.eval.hold import evaluated, hold_for_evaluation
from pipeline.eval.results import is_recorded, latest_evaluations, record, restore_lines
from pipeline.eval.runner import SetResult
from pipeline.rollout.loop import run_concurrency
from pipeline.run.config import validate_config
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig, EvalConfig, EvalSetConfig

SET = {"name": "held", "path": "held.jsonl"}


def config(tmp_path: Path, **eval_fields: Any) -> ArlConfig:
    return validate_config({"fileroot": str(tmp_path / "runs"), "num_steps": 10, "model": {"path": "m"},
                            "eval": {"sets": [SET], **eval_fields}})  # fmt: skip


@pytest.mark.parametrize(("fields", "num_steps", "versions"), [
    ({}, 10, []),  # offline only
    ({"at_start": True}, 10, [0]),
    ({"every": 4}, 10, [4, 8, 10]),  # multiples of `every`, and the last version
    ({"every": 5, "at_start": True}, 10, [0, 5, 10]),
    ({"every": 25}, 10, [10]),  # `every` past the run: the last version still
])  # fmt: skip
def test_due_versions(fields: dict[str, Any], num_steps: int, versions: list[int]) -> None:
    assert EvalConfig(sets=[EvalSetConfig(**SET)], **fields).versions(num_steps) == versions


def test_a_schedule_needs_sets_a_rollout_stage_and_slots_of_its_own(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"eval\.sets is empty"):
        validate_config({"model": {"path": "m"}, "eval": {"every": 5}})
    with pytest.raises(ConfigError, match=r"rollout\.source=external"):
        validate_config({"model": {"path": "m"}, "rollout": {"source": "external"},
                         "eval": {"at_start": True, "sets": [SET]}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"proxy.max_sessions=32 leaves rollout no session slot"):
        validate_config({"model": {"path": "m"}, "proxy": {"max_sessions": 32},
                         "eval": {"at_start": True, "sets": [SET]}})  # fmt: skip
    slots = {"proxy": {"max_sessions": 100}, "rollout": {"max_concurrency": 512}}
    in_run = validate_config({"model": {"path": "m"}, **slots, "eval": {"every": 5, "sets": [SET]}})
    assert run_concurrency(in_run) == 100 - 32, "rollout keeps the slots the evaluation does not hold"
    offline = validate_config({"model": {"path": "m"}, **slots, "eval": {"sets": [SET]}})
    assert run_concurrency(offline) == 100


def result(version: int, reward: float) -> SetResult:
    figures = {"prompts": 0, "runs": 0, "failed_runs": 0, "reward_mean": reward, "num_samples": 1}
    return SetResult("held", version, figures, [], [])


def test_the_trainer_holds_until_the_due_version_is_recorded(tmp_path: Path) -> None:
    cfg = config(tmp_path, every=5)
    paths = RunPaths(tmp_path / "run")
    assert hold_for_evaluation(paths, cfg, 3) == 0.0, "version 3 is not evaluated during the run"
    writer = threading.Timer(0.3, record, (paths, cfg, result(5, 0.5), "w"))
    writer.start()
    waited = hold_for_evaluation(paths, cfg, 5)
    writer.join()
    assert evaluated(paths, cfg, 5) and waited > 0, "it returned only once the shards were complete"
    assert hold_for_evaluation(paths, cfg, 5) == 0.0, "recorded: no wait"


def test_the_hold_ends_at_its_timeout_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(tmp_path, every=5, hold_timeout_s=0.2)
    paths = RunPaths(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="arl.eval"):
        started = time.monotonic()
        hold_for_evaluation(paths, cfg, 10)
    assert time.monotonic() - started < 30, "it gave up"
    assert "the evaluation of version 10 is not recorded after eval.hold_timeout_s=0s (sets held" in caplog.text


def test_a_line_cut_by_a_kill_is_restored_from_the_shards_once(tmp_path: Path) -> None:
    cfg = config(tmp_path, every=5)
    paths = RunPaths(tmp_path / "run")
    record(paths, cfg, result(5, 0.25), "engines at version 5")
    paths.eval_metrics.unlink()  # killed between the shards and the line
    assert is_recorded(paths, 5, "held") and latest_evaluations(paths) == []
    assert restore_lines(paths, cfg, [5, 10]) == 1
    assert restore_lines(paths, cfg, [5, 10]) == 0, "a line already there is not written twice"
    (line,) = [json.loads(x) for x in paths.eval_metrics.read_text().splitlines()]
    assert (line["version"], line["set"], line["reward_mean"], line["weights"]) == (
        5,
        "held",
        0.25,
        "engines at version 5",
    )
