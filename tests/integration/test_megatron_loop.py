"""The trainer loop (`run_trainer`) with `trainer.backend=megatron` on CPU: it learns, writes HF checkpoints
that transformers loads as they are, and a `--step N` rerun from the saved megatron optimizer state
reproduces the version exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from pipeline.run.paths import RunPaths
from pipeline.run.sinks import read_jsonl
from pipeline.run.stage import StageContext
from pipeline.trainer.loop import run_trainer

OVERRIDES = ["trainer.backend=megatron", "num_steps=3", "trainer.minibatches=2", "trainer.optimizer.lr=0.003",
             "trainer.keep_checkpoints=5", "trainer.wait_timeout_s=5", "rollout.max_staleness=10"]  # fmt: skip


def completion_logprob(model_dir: Path, rows: list[dict]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logits = model(input_ids=ids, use_cache=False).logits[0]
            logp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append(float((logp * torch.tensor(row["loss_mask"][1:])).sum()))
    return out


@pytest.mark.slow
def test_megatron_loop_learns_checkpoints_and_reruns_a_step_exactly(make_train_run, tiny_model_dir: Path) -> None:
    from pipeline.run.shards import read_step

    paths: RunPaths = make_train_run(steps=[0, 1, 2], overrides=OVERRIDES)
    assert run_trainer(StageContext.from_run_dir("train", paths.root)) == 0

    rows = read_step(paths, 0).to_pylist()
    before = completion_logprob(tiny_model_dir, rows)
    after = completion_logprob(paths.checkpoint_dir(3), rows)  # plain transformers load of our checkpoint
    gains = [a - b for a, b in zip(after, before, strict=True)]
    good = [g for g, r in zip(gains, rows, strict=True) if r["reward"] == 1.0]
    bad = [g for g, r in zip(gains, rows, strict=True) if r["reward"] == 0.0]
    assert min(good) > 0 > max(bad), (good, bad)

    records = read_jsonl(paths.train_metrics)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in records)
    state = sorted(p.name for p in paths.trainer_state_dir(2).iterdir())
    assert "megatron_layout.json" in state and "optimizer_rank00000.pt" in state

    version_2 = load_file(str(paths.checkpoint_dir(2) / "model.safetensors"))
    # redo step 1 from version 1 + its optimizer state
    assert run_trainer(StageContext.from_run_dir("train", paths.root, only_step=1)) == 0
    redone = load_file(str(paths.checkpoint_dir(2) / "model.safetensors"))
    assert redone.keys() == version_2.keys()
    for name, tensor in version_2.items():
        assert torch.equal(redone[name], tensor), name
