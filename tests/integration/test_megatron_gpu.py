"""The megatron backend on a CUDA GPU (bf16, megatron's DDP and optimizer). Skipped without CUDA.

Tolerance, as in benchmarks/megatron_gpu.py: megatron in bf16 must be no further from the fp32 torch
backend than twice the torch backend's own bf16 error (+1e-3), because bf16 rounding (2^-9 relative per
op) has no model-independent absolute bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.xfail(
    strict=True,
    reason="measured on an H100: loss_rel 7.4e-3 > bound 5.2e-3 (the torch backend's own bf16 error is 2.1e-3). "
    "megatron keeps weights and the residual stream in bf16 while the torch backend autocasts over fp32 weights, "
    "so on the tiny model's small loss (~0.05) its relative error is ~3.5x; fp32 on CUDA matches within 1e-6 "
    "(next test). Open: an fp32 residual stream (megatron's option crashes with the local layer spec) or a "
    "bf16-weights reference for the bound (docs/megatron.md, GPU checks)",
)
def test_bf16_step_is_as_close_to_fp32_as_the_torch_backend(tiny_model_dir: Path, tmp_path: Path) -> None:
    from benchmarks import megatron_gpu as bench  # its configs, one-step runner and error measures

    rows = _rows(tiny_model_dir)
    runs = {}
    for name, backend, bf16 in [("fp32", "torch", False), ("hf", "torch", True), ("megatron", "megatron", True)]:
        config = bench.make_config(tiny_model_dir, tmp_path, backend, bf16, 256)
        runs[name] = bench.one_step(config, tiny_model_dir, bench.make_plan(rows, config, 256))
    hf, mg = bench.errors(runs["hf"], runs["fp32"]), bench.errors(runs["megatron"], runs["fp32"])
    for key in hf:
        assert mg[key] <= 2 * hf[key] + 1e-3, (key, mg[key], hf[key])


def test_fp32_step_on_cuda_equals_the_torch_backend(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Without bf16 (trainer.bf16=false) the megatron path on CUDA (its DDP, optimizer, packed rope, SDPA
    attention, conversion) computes the torch backend's numbers: every error within 1e-5 (measured on an
    H100: <= 1e-6)."""
    from benchmarks import megatron_gpu as bench  # its configs, one-step runner and error measures

    rows = _rows(tiny_model_dir)
    runs = {}
    for name, backend in [("torch", "torch"), ("megatron", "megatron")]:
        config = bench.make_config(tiny_model_dir, tmp_path, backend, False, 256)
        runs[name] = bench.one_step(config, tiny_model_dir, bench.make_plan(rows, config, 256))
    for key, value in bench.errors(runs["megatron"], runs["torch"]).items():
        assert value <= 1e-5, (key, value)


def _rows(model_dir: Path) -> list[Any]:
    from pipeline.trainer.synthetic import add_behaviour_logprobs, synthetic_rows

    return add_behaviour_logprobs(synthetic_rows(0, completion_lens=[5, 9, 13]), model_dir)
