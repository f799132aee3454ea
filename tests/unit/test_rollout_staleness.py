"""Staleness gate and per-token version checks; constant-group filtering; step statistics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.errors import WaitTimeout
from pipeline.rollout.staleness import (
    required_version,
    split_stale,
    staleness_histogram,
    wait_for_version,
)
from pipeline.rollout.stats import StepTally, drop_constant_groups
from pipeline.run.handoff import write_json_atomic
from pipeline.run.paths import RunPaths
from pipeline.run.weight_version import published_version
from schemas.trajectory import TrajectoryRow


def _row(group: str, reward: float, versions: list[int], session: str = "s") -> TrajectoryRow:
    mask = [0, *([1] * len(versions))]
    return TrajectoryRow(group_id=group, session_id=session, reward=reward, input_ids=list(range(len(mask))),
                         loss_mask=mask, versions=[-1, *versions], logprobs=[0.0, *([-0.5] * len(versions))],
                         sample_id=f"{session}-{len(versions)}", parent_id=None, prompt_len=1, num_turns=1,
                         finish_reason="stop", created_at=1_700_000_000_000, metadata="{}")  # fmt: skip


def test_required_version() -> None:
    assert required_version(0, 1) == 0
    assert required_version(5, 0) == 5
    assert required_version(5, 2) == 3


def test_published_version(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert published_version(paths) == 0  # version 0 needs no file
    write_json_atomic(paths.weight_version, {"version": 3, "checkpoint": None})
    assert published_version(paths) == 3


def test_stale_samples_are_dropped_and_counted() -> None:
    rows = [_row("g", 1.0, [4, 4]), _row("g", 1.0, [3, 4]), _row("g", 1.0, [2, 4])]
    kept, dropped = split_stale(rows, step=5, max_staleness=2)  # bound: version >= 3
    assert dropped == 1 and [r.versions for r in kept] == [[-1, 4, 4], [-1, 3, 4]]
    assert staleness_histogram(rows, 5) == {"1": 1, "2": 1, "3": 1}


def test_constant_groups() -> None:
    rows = [_row("a", 1.0, [0]), _row("a", 1.0, [0]), _row("b", 0.0, [0]), _row("b", 1.0, [0])]
    kept, groups, samples = drop_constant_groups(rows)
    assert (groups, samples) == (1, 2) and {r.group_id for r in kept} == {"b"}


def test_step_summary() -> None:
    tally = StepTally(step=2, weight_version=1)
    tally.add_finished(rejected=False, num_interactions=2, prefix_breaks=1, samples=1)
    tally.add_finished(rejected=True, num_interactions=1, prefix_breaks=0, samples=1)
    tally.add_error("Traceback: boom", timed_out=True)
    stats = tally.summary([_row("a", 1.0, [1]), _row("a", 0.0, [2], session="t")])
    assert stats["reward_mean"] == 0.5 and stats["reward_std"] == 0.5
    assert (stats["runs"], stats["rejected"], stats["agent_errors"], stats["timeouts"]) == (3, 1, 1, 1)
    assert stats["turns_mean"] == 2.0 and stats["prefix_breaks"] == 1 and stats["sessions"] == 2
    assert stats["staleness_hist"] == {"0": 1, "1": 1} and stats["error_rate"] == pytest.approx(1 / 3)


async def test_wait_blocks_until_the_version_arrives(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)

    async def publish_later() -> None:
        await asyncio.sleep(0.3)
        write_json_atomic(paths.weight_version, {"version": 2, "checkpoint": None})

    publisher = asyncio.create_task(publish_later())
    version = await wait_for_version(paths, 2, timeout_s=30, poll_s=0.05)
    await publisher
    assert version == 2


async def test_wait_also_needs_the_engines_version(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    write_json_atomic(paths.weight_version, {"version": 1, "checkpoint": None})

    async def engines() -> int:
        return 0

    with pytest.raises(WaitTimeout, match="engine servers report version 0"):
        await wait_for_version(paths, 1, timeout_s=0.2, poll_s=0.05, engine_version=engines)


async def test_no_server_answering_is_waited_out_within_the_deadline(tmp_path: Path) -> None:
    """An inference stage being replaced (no server registered for a moment) is not a rollout failure."""
    from pipeline.engine.client import EngineError

    paths = RunPaths(tmp_path)
    write_json_atomic(paths.weight_version, {"version": 1, "checkpoint": None})
    answers: list[int | None] = [None, None, 1]

    async def engines() -> int:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if answer is None:
            raise EngineError("no inference servers known: is the inference stage running?")
        return answer

    assert await wait_for_version(paths, 1, timeout_s=30, poll_s=0.01, engine_version=engines) == 1

    async def never() -> int:
        raise EngineError("no inference servers known: is the inference stage running?")

    with pytest.raises(WaitTimeout, match="did not answer: no inference servers known"):
        await wait_for_version(paths, 1, timeout_s=0.2, poll_s=0.05, engine_version=never)


async def test_wait_timeout_names_the_trainer_and_its_log(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.stage_log("train", 3).parent.mkdir(parents=True)
    paths.stage_log("train", 3).write_text("")
    with pytest.raises(WaitTimeout) as info:
        await wait_for_version(paths, 1, timeout_s=0.2, poll_s=0.05)
    message = str(info.value)
    assert "weight_version.json" in message and "train stage" in message
    assert str(paths.stage_log("train", 3)) in message
