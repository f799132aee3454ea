"""The staleness rule (one function, its inverse, and the three places that use it), the staleness gate and
per-token version checks; constant-group filtering; step statistics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import WaitTimeout
from pipeline.rollout.external import Admission
from pipeline.rollout.staleness import split_stale, staleness_histogram, wait_for_version
from pipeline.rollout.stats import StepTally, drop_constant_groups
from pipeline.run.handoff import write_json_atomic
from pipeline.run.paths import RunPaths
from pipeline.run.weight_version import newest_servable_step, oldest_usable_version, published_version
from pipeline.trainer.data import Sample, filter_samples
from schemas.trajectory import TrajectoryRow


def _row(group: str, reward: float, versions: list[int], session: str = "s") -> TrajectoryRow:
    mask = [0, *([1] * len(versions))]
    return TrajectoryRow(group_id=group, session_id=session, reward=reward, input_ids=list(range(len(mask))),
                         loss_mask=mask, versions=[-1, *versions], logprobs=[0.0, *([-0.5] * len(versions))],
                         sample_id=f"{session}-{len(versions)}", parent_id=None, prompt_len=1, num_turns=1,
                         finish_reason="stop", created_at=1_700_000_000_000, metadata="{}")  # fmt: skip


# (step k, max_staleness s, oldest usable version = max(k - s, 0))
BOUNDS = [
    (0, 0, 0),  # synchronous: step 0 trains on the initial weights
    (0, 1, 0),
    (1, 2, 0),  # k < s: clamped, the initial weights are the oldest there are
    (2, 2, 0),  # k = s
    (3, 2, 1),
    (5, 0, 5),  # s = 0: only the newest weights
    (5, 2, 3),
    (7, 1, 6),
    (0, 5, 0),
]

# (published version v, max_staleness s, newest step v may serve = v + s)
SERVES = [
    (0, 0, 0),
    (0, 1, 1),
    (0, 3, 3),  # steps 0..3 may all use the initial weights
    (3, 0, 3),
    (3, 2, 5),
    (6, 1, 7),
]


@pytest.mark.parametrize(("step", "max_staleness", "expected"), BOUNDS)
def test_oldest_usable_version(step: int, max_staleness: int, expected: int) -> None:
    assert oldest_usable_version(step, max_staleness) == expected


@pytest.mark.parametrize(("version", "max_staleness", "expected"), SERVES)
def test_newest_servable_step(version: int, max_staleness: int, expected: int) -> None:
    assert newest_servable_step(version, max_staleness) == expected


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 5])
def test_the_two_directions_are_one_rule(max_staleness: int) -> None:
    """Version v may serve step k exactly when k <= newest_servable_step(v): the admission's reading
    is the inverse of the bound, not a second rule."""
    for version in range(12):
        for step in range(20):
            usable = oldest_usable_version(step, max_staleness) <= version
            assert usable == (step <= newest_servable_step(version, max_staleness)), (version, step)


def _sample(version: int, sample_id: str) -> Sample:
    return Sample(sample_id, "g", np.arange(3), np.array([0, 1, 1], dtype=np.int8), np.zeros(3, dtype=np.float32),
                  np.array([-1, version, version + 1], dtype=np.int32), 1.0)  # fmt: skip


@pytest.mark.parametrize(("step", "max_staleness", "bound"), BOUNDS)
def test_the_rollout_filter_uses_the_bound(step: int, max_staleness: int, bound: int) -> None:
    rows = [_row("g", 1.0, [v, v + 1], session=f"v{v}") for v in range(max(bound - 1, 0), bound + 2)]
    kept, dropped = split_stale(rows, step, max_staleness)
    assert [r.session_id for r in kept] == [f"v{v}" for v in range(bound, bound + 2)]
    assert dropped == (1 if bound > 0 else 0)


@pytest.mark.parametrize(("step", "max_staleness", "bound"), BOUNDS)
def test_the_trainer_filter_uses_the_bound(step: int, max_staleness: int, bound: int) -> None:
    samples = [_sample(v, f"v{v}") for v in range(max(bound - 1, 0), bound + 2)]
    data = filter_samples(step, samples, max_staleness)
    assert [s.sample_id for s in data.samples] == [f"v{v}" for v in range(bound, bound + 2)]
    assert data.stale_dropped == (1 if bound > 0 else 0)
    assert data.staleness == [step - v for v in range(bound, bound + 2)]


@pytest.mark.parametrize(("version", "max_staleness", "newest"), SERVES)
def test_the_external_admission_uses_the_bound(version: int, max_staleness: int, newest: int) -> None:
    """Slots are granted for exactly the steps the bound lets `version` serve, one batch per step."""
    for step in range(newest + 3):
        slots = Admission().slots(step=step, version=version, max_staleness=max_staleness, num_steps=100,
                                  batch_size=4, buffered=0, in_flight=0, started_total=0)  # fmt: skip
        served = oldest_usable_version(step, max_staleness) <= version
        assert slots == ((newest - step + 1) * 4 if served else 0), (step, slots)


def test_admission_stops_at_the_last_step() -> None:
    assert Admission().slots(step=8, version=5, max_staleness=5, num_steps=10, batch_size=4, buffered=1,
                             in_flight=0, started_total=0) == 2 * 4 - 1  # fmt: skip


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
