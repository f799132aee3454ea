"""Several tasks in one run: the per-step draw follows the weights, is a pure function of the step (resume and
`--step N` exact), walks each task's own prompt sequence without gaps or repeats, and the config's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.agents.dataset import DataError, check_cursor, write_cursor
from pipeline.errors import ConfigError
from pipeline.rollout.tasks import TaskMix, task_figures
from pipeline.run.config import validate_config
from schemas.config import DatasetConfig, TaskConfig
from schemas.trajectory import TrajectoryRow


def tasks(tmp_path: Path, weights: tuple[float, ...] = (3.0, 1.0), sizes: tuple[int, ...] = (7, 5)) -> list[TaskConfig]:
    out = []
    for i, (weight, size) in enumerate(zip(weights, sizes, strict=True)):
        data = tmp_path / f"task{i}.jsonl"
        data.write_text("".join(json.dumps({"q": f"t{i}-{j}"}) + "\n" for j in range(size)))
        out.append(TaskConfig(name=f"t{i}", agent="a.py:A", dataset=DatasetConfig(path=str(data), seed=i),
                              weight=weight))  # fmt: skip
    return out


def test_the_mix_follows_the_weights_over_many_steps(tmp_path: Path) -> None:
    mix = TaskMix(tasks(tmp_path, (3.0, 1.0, 0.5), (7, 5, 3)), batch_size=8, seed=0)
    counts = sum(mix.counts(k) for k in range(2000))
    shares = counts / counts.sum()
    # 16,000 draws: the standard error of a share is at most 0.004, so 0.02 is five of them
    assert shares == pytest.approx([3 / 4.5, 1 / 4.5, 0.5 / 4.5], abs=0.02)
    assert all(mix.counts(k).sum() == 8 for k in range(50))
    assert any(mix.counts(k)[2] == 0 for k in range(50)) and any(mix.counts(k)[2] > 0 for k in range(50)), (
        "a draw per step, not a fixed rounding"
    )


def test_a_step_is_a_pure_function_of_its_number(tmp_path: Path) -> None:
    straight = TaskMix(tasks(tmp_path), batch_size=4, seed=5)
    in_order = [straight.prompts(k) for k in range(40)]
    resumed = TaskMix(tasks(tmp_path), batch_size=4, seed=5)  # a restarted stage asks for step 37 first
    assert resumed.prompts(37) == in_order[37] and resumed.prompts(3) == in_order[3]
    other_seed = TaskMix(tasks(tmp_path), batch_size=4, seed=6)
    assert [other_seed.prompts(k) for k in range(40)] != in_order


def test_each_task_walks_its_own_sequence_without_gaps_or_repeats(tmp_path: Path) -> None:
    mix = TaskMix(tasks(tmp_path), batch_size=4, seed=1)
    prompts = [p for k in range(30) for p in mix.prompts(k)]
    for task, size in (("t0", 7), ("t1", 5)):
        mine = [p for p in prompts if p.task == task]
        assert [p.position for p in mine] == list(range(len(mine)))
        for epoch in range(len(mine) // size):  # every full epoch holds each row once
            assert sorted(p.index for p in mine if p.epoch == epoch) == list(range(size))
        assert all(p.data["q"] == f"{task}-{p.index}" for p in mine)


def test_the_cursor_records_positions_and_refuses_changed_weights(tmp_path: Path) -> None:
    mix = TaskMix(tasks(tmp_path), batch_size=4, seed=1)
    cursor = tmp_path / "cursor.json"
    write_cursor(cursor, mix, 9, "a,b")
    record = json.loads(cursor.read_text())
    assert sum(record["next_positions"].values()) == 40 and record["task_seed"] == 1
    assert check_cursor(cursor, TaskMix(tasks(tmp_path), batch_size=4, seed=1)) is not None
    with pytest.raises(DataError):
        check_cursor(cursor, TaskMix(tasks(tmp_path, (1.0, 1.0)), batch_size=4, seed=1))


def row(task: str, reward: float, exact: float, sample: str = "x") -> TrajectoryRow:
    meta = json.dumps({"task": task, "metrics": {"exact": exact}})
    return TrajectoryRow(session_id=sample, sample_id=sample, parent_id=None, group_id=f"g-{task}", input_ids=[1, 2],
                         loss_mask=[0, 1], logprobs=[0.0, -0.5], versions=[-1, 0], reward=reward, prompt_len=1,
                         num_turns=1, finish_reason="stop", created_at=0, metadata=meta)  # fmt: skip


def test_the_trainer_reads_each_samples_task_only_when_asked(tmp_path: Path) -> None:
    from pipeline.run.paths import RunPaths
    from pipeline.run.shards import write_step
    from pipeline.trainer.data import load_step

    paths = RunPaths(tmp_path / "run")
    rows = [row("a", 1.0, 1.0, "s1").at_step(0), row("b", 0.0, 0.0, "s2").at_step(0)]
    write_step(paths, 0, rows, producer="rollout", tokenizer="tok")
    assert sorted(s.task for s in load_step(paths, 0, 1, with_tasks=True).samples) == ["a", "b"]
    assert {s.task for s in load_step(paths, 0, 1).samples} == {"default"}


def test_figures_per_task_by_hand() -> None:
    figures = task_figures([row("a", 1.0, 1.0), row("a", 0.0, 0.0), row("b", 0.5, 1.0)], ["a", "b", "c"])
    assert figures["task/a/samples"] == 2 and figures["task/a/reward_mean"] == 0.5
    assert figures["task/a/agent/exact"] == 0.5 and figures["task/b/agent/exact"] == 1.0
    assert figures["task/c/samples"] == 0 and figures["task/c/reward_mean"] is None


def test_tasks_replace_the_one_task_shorthand() -> None:
    task = {"name": "a", "agent": "a.py:A", "dataset": {"path": "a.jsonl"}}
    with pytest.raises(ConfigError, match=r"rollout\.tasks is set, and so is rollout\.agent"):
        validate_config({"model": {"path": "m"}, "rollout": {"agent": "b.py:B", "tasks": [task]}})
    with pytest.raises(ConfigError, match=r"the names \['a'\] are used twice"):
        validate_config({"model": {"path": "m"}, "rollout": {"tasks": [task, task]}})
    with pytest.raises(ConfigError, match="give each set its `agent`"):
        validate_config({"model": {"path": "m"}, "rollout": {"tasks": [task]},
                         "eval": {"sets": [{"name": "e", "path": "e.jsonl"}]}})  # fmt: skip
    one = validate_config({"model": {"path": "m"}}).rollout.task_list()
    assert [(t.name, t.weight) for t in one] == [("default", 1.0)]
