"""`benchmarks/lora.py` on the tiny model, in this process: every figure group runs and the sizes compare the right
way round. The harness is imported as a module (the code the benchmark runs); timing and peak memory are the
benchmark's business, never asserted here."""

from __future__ import annotations

import argparse
from pathlib import Path


def test_full_and_lora_figures_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from benchmarks import lora as harness

    configs = {}
    for label, rank in (("full", 0), ("lora r4", 4)):
        spec = harness.Spec(label, str(tiny_model_dir), str(tmp_path), seqs=2, seq_len=32, steps=1, rank=rank)
        configs[label] = harness.measure(spec)
    full, lora = configs["full"], configs["lora r4"]
    assert 0 < lora["trainable_params"] < full["trainable_params"] == full["params"]
    assert full["grad_bytes"] == full["trainable_bytes"] and lora["grad_bytes"] == lora["trainable_bytes"]
    assert 2 * lora["trainable_bytes"] <= lora["optimizer_bytes"] < full["optimizer_bytes"]  # AdamW: m, v, step
    assert lora["adapter_checkpoint_bytes"] < full["full_checkpoint_bytes"] < lora["merged_checkpoint_bytes"]
    assert lora["merge_s"] > 0 and "merge_s" not in full
    assert not list(tmp_path.glob("run-*/checkpoints/step_*"))  # each checkpoint removed once measured

    args = argparse.Namespace(seqs=2, seq_len=32, steps=1, small=True)
    summary = harness.summarize({"model_bytes": 1, "configs": configs}, args)
    assert summary["ratios"]["lora r4 adapter checkpoint / full checkpoint bytes"] < 1
