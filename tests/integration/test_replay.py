"""`arl replay` on real runs of the tiny model: the weights that sampled a step give back the engine's
log-probs, other weights do not, a pruned version is named, and the per-token Parquet reads in DuckDB."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.run.paths import RunPaths
from pipeline.run.shards import read_step
from pipeline.run.stage import StageContext
from pipeline.trainer.loop import run_trainer

FAST = ["trainer.optimizer.lr=0.003", "trainer.wait_timeout_s=5", "rollout.max_staleness=10", "num_steps=1"]


def replay(*args: str) -> dict:
    result = CliRunner().invoke(app, ["replay", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_replay_under_the_sampling_weights_and_under_another_checkpoint(make_train_run, tiny_model_dir: Path) -> None:
    paths: RunPaths = make_train_run(steps=[0, 3], overrides=FAST)
    sampled = sum(sum(m[1:]) for m in read_step(paths, 0).column("loss_mask").to_pylist())

    # Version 0 sampled step 0 (behaviour log-probs of the tiny model's own forward, as the hf engine records them).
    same = replay(str(paths.root), "--step", "0")
    assert same["tokens"] == sampled and same["checkpoints"] == {str(tiny_model_dir): [0]}
    assert same["max_abs_delta"] < 1e-5 and abs(same["kl_k3"]) < 1e-9
    query = "SELECT count(*), max(abs(delta)), count(DISTINCT sample_id), min(pos) FROM '{}' WHERE run = 'x/run' "
    rows = duckdb.sql(query.format(paths.replay_file(0)) + "AND step = 0 AND version = 0").fetchall()[0]
    assert rows is not None and rows[0] == sampled and rows[1] < 1e-5 and rows[2] == 8 and rows[3] >= 1
    worst = same["worst"][0]
    assert {"token", "context", "delta", "sample_id", "pos"} <= set(worst) and isinstance(worst["token"], str)

    # Step 3 says version 3 sampled it: no such checkpoint, one line naming it and what is kept, exit 2.
    missing = CliRunner().invoke(app, ["replay", str(paths.root), "--step", "3"])
    assert missing.exit_code == 2 and "checkpoints of [3] are gone" in missing.output and "kept: []" in missing.output

    # After one update the weights differ: under version 1 the same tokens get clearly other log-probs.
    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0
    out = paths.root / "other.parquet"
    other = replay(str(paths.root), "--step", "0", "--checkpoint", str(paths.checkpoint_dir(1)), "--output", str(out))
    assert other["tokens"] == sampled and other["mean_abs_delta"] > 1e-2 and other["kl_k3"] > 1e-4
    count, mean_abs = duckdb.sql(
        f"SELECT count(*), avg(abs(trainer_logprob - engine_logprob)) FROM '{out}'"
    ).fetchall()[0]
    assert count == sampled and abs(mean_abs - other["mean_abs_delta"]) < 1e-9


def test_lora_replay_loads_each_versions_adapter(make_train_run) -> None:
    """Step 1 claims version 1: its adapter on the base scores it, as the merged copy of the same weights does."""
    paths: RunPaths = make_train_run(steps=[0, 1], overrides=[*FAST, "trainer.lora.rank=4", "trainer.lora.alpha=8",
                                                              "trainer.optimizer.lr=0.05"])  # fmt: skip
    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0
    by_adapter = replay(str(paths.root), "--step", "1", "--output", str(paths.root / "a.parquet"))
    assert by_adapter["checkpoints"] == {str(paths.checkpoint_dir(1)): [1]} and by_adapter["mean_abs_delta"] > 1e-3
    merged = replay(str(paths.root), "--step", "1", "--checkpoint", str(paths.weights_dir(1)),
                    "--output", str(paths.root / "m.parquet"))  # fmt: skip
    assert merged["mean_abs_delta"] > 1e-3
    diff = duckdb.sql(f"SELECT max(abs(a.trainer_logprob - m.trainer_logprob)), count(*) FROM '{paths.root}/a.parquet'"
                      f" a JOIN '{paths.root}/m.parquet' m USING (sample_id, pos)").fetchall()[0]  # fmt: skip
    assert diff is not None and diff[0] < 1e-5 and diff[1] == by_adapter["tokens"]
