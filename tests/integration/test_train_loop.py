"""The trainer loop in-process on the tiny model: learning, checkpoints, metrics, waits, staleness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.errors import SchemaError, WaitTimeout
from pipeline.run.handoff import read_json
from pipeline.run.paths import RunPaths
from pipeline.run.shards import read_step
from pipeline.run.sinks import read_jsonl
from pipeline.run.stage import StageContext
from pipeline.trainer.loop import run_trainer

FAST = ["trainer.optimizer.lr=0.003", "trainer.wait_timeout_s=5", "rollout.max_staleness=10"]


def completion_logprob(model_dir: Path, rows: list[dict]) -> list[float]:
    """Sum of teacher-forced log-probs over each row's sampled tokens under the weights in `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append(float((logp * torch.tensor(row["loss_mask"][1:])).sum()))
    return out


def test_training_raises_logprob_of_rewarded_completions(make_train_run, tiny_model_dir: Path) -> None:
    paths: RunPaths = make_train_run(steps=[0, 1, 2], overrides=[*FAST, "num_steps=3", "trainer.minibatches=2",
                                     "trainer.keep_checkpoints=2"])  # fmt: skip
    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0

    rows = read_step(paths, 0).to_pylist()
    before = completion_logprob(tiny_model_dir, rows)
    after = completion_logprob(paths.checkpoint_dir(3), rows)
    gains = [a - b for a, b in zip(after, before, strict=True)]
    good = [g for g, r in zip(gains, rows, strict=True) if r["reward"] == 1.0]
    bad = [g for g, r in zip(gains, rows, strict=True) if r["reward"] == 0.0]
    assert min(good) > 0 > max(bad), (good, bad)

    # Checkpoints: newest two kept, LATEST and the announced version point at the last.
    assert paths.complete_checkpoints() == [2, 3]
    assert paths.latest.read_text().strip() == "3"
    announced = read_json(paths.weight_version)
    assert announced["version"] == 3 and announced["checkpoint"] == "checkpoints/step_000003"
    assert (paths.trainer_state_dir(3) / "_COMPLETE").exists() and not paths.trainer_state_dir(1).exists()

    records = read_jsonl(paths.train_metrics)
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("loss", "kl_behav_k1", "kl_behav_k3", "entropy", "clip_frac", "grad_norm", "imp_weight",
                "imp_weight_max", "adv_mean", "adv_std", "reward_mean", "tokens_per_s", "staleness_max",
                "time_wait_s", "time_compute_s", "time_publish_s"):  # fmt: skip
        assert key in records[-1], key
    assert records[0]["updates"] == 2 and records[0]["reward_mean"] == pytest.approx(0.5)
    assert list(paths.tensorboard.iterdir()), "TensorBoard events written"


def test_checkpoint_loads_with_plain_transformers(make_train_run) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = make_train_run(steps=[0], overrides=[*FAST, "num_steps=1"])
    run_trainer(StageContext.from_run_dir("train", paths.root))
    ckpt = paths.checkpoint_dir(1)
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "_COMPLETE"} <= names
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert (
        model.config.tie_word_embeddings
        and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    )
    assert AutoTokenizer.from_pretrained(str(ckpt)).encode("hello world")


def test_missing_step_times_out_naming_manifest_stage_and_log(make_train_run) -> None:
    paths = make_train_run(steps=[], overrides=["trainer.wait_timeout_s=0.3", "num_steps=1"])
    with pytest.raises(WaitTimeout) as err:
        run_trainer(StageContext.from_run_dir("train", paths.root))
    msg = str(err.value)
    assert "trajectories/step_000000/_MANIFEST.json" in msg and "rollout stage" in msg
    assert str(paths.latest_log("rollout")) in msg


def test_stale_samples_are_dropped_and_counted(make_train_run) -> None:
    # Step 3's samples claim version 0 while max_staleness=1 allows >= 2: half stale, half fresh.
    paths = make_train_run(steps=[], overrides=["num_steps=4", "rollout.max_staleness=1"])
    from pipeline.trainer.data import filter_samples, rows_to_samples
    from pipeline.trainer.synthetic import synthetic_rows

    stale = rows_to_samples(synthetic_rows(3, version=0, num_groups=1))
    fresh = rows_to_samples(synthetic_rows(3, version=2, num_groups=1, seed=1))
    data = filter_samples(3, stale + fresh, max_staleness=1)
    assert data.stale_dropped == len(stale) and len(data.samples) == len(fresh)
    assert data.staleness == [1] * len(fresh)
    with pytest.raises(SchemaError, match="all 4 samples dropped"):
        filter_samples(3, stale, max_staleness=1)
    del paths


def test_metrics_file_is_json_lines(make_train_run) -> None:
    paths = make_train_run(steps=[0], overrides=[*FAST, "num_steps=1", "trainer.algorithm.kl_coef=0.05",
                                                 "trainer.algorithm.loss_agg=sequence"])  # fmt: skip
    run_trainer(StageContext.from_run_dir("train", paths.root))
    lines = paths.train_metrics.read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["kl_ref"] >= 0 and record["version"] == 1
    # the trainer's half of the step timeline: every interval measured, and they fit in the step's wall time
    parts = ["time_wait_s", "time_load_s", "time_compute_s", "time_checkpoint_s", "time_eval_hold_s", "time_publish_s"]
    assert all(record[k] >= 0 for k in parts) and record["time_compute_s"] > 0
    assert sum(record[k] for k in parts) <= record["time_step_s"]
    assert record["cpu_s"] > 0, "the step's CPU time: the updates at least"
