"""The trainer's per-step metrics (metrics/train.jsonl, TensorBoard under metrics/tb/, W&B if configured).

Token diagnostics arrive as sums over tokens from every micro-batch (and every rank, all-reduced);
they become means here, so a metric never depends on how samples were packed or sharded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.run.paths import RunPaths
from pipeline.run.sinks import JsonlSink, MetricsSink, MultiSink, NullSink, TensorBoardSink, open_wandb
from pipeline.trainer.backend import MinibatchStats
from pipeline.trainer.data import StepData
from pipeline.trainer.losses import MISMATCH_LOG_RATIO
from schemas.config import ArlConfig

# Dense bf16 tensor-core peak per GPU (FLOP/s), from the vendors' datasheets (SXM parts).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def open_sinks(config: ArlConfig, paths: RunPaths, rank: int, *, redo_step: int | None = None) -> MetricsSink:
    """JSONL + TensorBoard (+ W&B when `metrics.wandb` is set) on rank 0; a null sink elsewhere (one writer
    per file, one W&B run per stage). `redo_step`: the `--step N` being redone (W&B logs it to a run of its own)."""
    if rank != 0:
        return NullSink()
    return MultiSink(
        JsonlSink(paths.train_metrics),
        TensorBoardSink(paths.tensorboard, "train"),
        open_wandb(config, paths, "train", prefix="train", redo_step=redo_step),
    )


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of one device, or None when unknown (CPU: MFU is not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


@dataclass
class Timings:
    """The trainer's half of a step's timeline (docs/operations.md, "Step timeline")."""

    started: float = field(default_factory=time.perf_counter)
    cpu_started: float = field(default_factory=time.process_time)
    """CPU time of this process (rank 0) at the step's start: `cpu_s` in the row is what the step used."""
    wait_s: float = 0.0
    load_s: float = 0.0
    """Reading and checking the step's shards."""
    compute_s: float = 0.0
    """Proximal/reference log-probs plus the updates."""
    checkpoint_s: float = 0.0
    publish_s: float = 0.0
    weight_sync_s: float = 0.0
    """Of `publish_s`: pausing the servers and moving the tensors."""
    verify_s: float = 0.0
    """Of `publish_s`: checking every server holds the version (docs/reliability.md)."""
    eval_hold_s: float = 0.0
    """Before the publication: waiting for the in-run evaluation of the version the engines serve
    (`pipeline.eval.hold`)."""
    servers_recovered: int = 0
    """Servers taken out during the publication (failed to update or verify) for the inference stage to recover."""


def publish_figures(timings: Timings) -> dict[str, float]:
    """The publication's part of a step's metrics row, and the step's wall time (it ends with the publication)."""
    return {
        "time_publish_s": timings.publish_s,
        "time_eval_hold_s": timings.eval_hold_s,
        "weight_sync_s": timings.weight_sync_s,
        "verify_s": timings.verify_s,
        "servers_recovered": timings.servers_recovered,
        "time_step_s": time.perf_counter() - timings.started,
        "cpu_s": time.process_time() - timings.cpu_started,
    }


def step_metrics(
    data: StepData,
    advantages: np.ndarray,
    updates: list[MinibatchStats],
    timings: Timings,
    *,
    num_params: int,
    world_size: int,
    peak: float | None,
    version: int,
) -> dict[str, Any]:
    """One flat dict of everything a person watches for one step."""
    rewards = np.array([s.reward for s in data.samples])
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for u in updates:
        for k, v in u.sums.items():
            sums[k] = sums.get(k, 0.0) + v
        for k, v in u.maxima.items():
            maxima[k] = max(maxima.get(k, float("-inf")), v)
    trained = max(sums.pop("tokens", 0.0), 1.0)
    tokens = sum(u.tokens for u in updates)
    out: dict[str, Any] = {
        "version": version,
        "samples": len(data.samples),
        "stale_dropped": data.stale_dropped,
        "untrainable_dropped": data.untrainable_dropped,
        "staleness_mean": float(np.mean(data.staleness)) if data.staleness else 0.0,
        "staleness_max": int(max(data.staleness, default=0)),
        **version_mix(data),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "adv_mean": float(advantages.mean()),
        "adv_std": float(advantages.std()),
        "adv_min": float(advantages.min()),
        "adv_max": float(advantages.max()),
        "adv_zero_frac": float(np.mean(np.abs(advantages) < 1e-8)),
        "loss": float(np.mean([u.loss for u in updates])),
        "grad_norm": float(np.mean([u.grad_norm for u in updates])),
        "grad_norm_max": float(max(u.grad_norm for u in updates)),
        "lr": updates[-1].lr,
        "updates": len(updates),
        "tokens": tokens,
        "trained_tokens": int(trained),
        "tokens_per_s": tokens / timings.compute_s if timings.compute_s > 0 else 0.0,
        "time_wait_s": timings.wait_s,
        "time_load_s": timings.load_s,
        "time_compute_s": timings.compute_s,
        "time_checkpoint_s": timings.checkpoint_s,
        **publish_figures(timings),
        "world_size": world_size,
    }
    out.update({k: v / trained for k, v in sums.items()})
    out.update(maxima)
    out.update(ratio_percentiles(updates))
    if peak is not None and timings.compute_s > 0:
        # Forward + backward of the updates; the proximal/reference forwards are not counted.
        out["mfu"] = 6.0 * num_params * tokens / timings.compute_s / (peak * world_size)
    return out


def version_mix(data: StepData) -> dict[str, float]:
    """Per-token staleness: with `inference.update_mode: interrupt` one sample's tokens can come from two
    versions (paused across a weight update); `staleness_mean` counts each sample by its oldest token,
    these count every sampled token by its own version."""
    token_staleness = [data.step - s.versions[s.loss_mask == 1] for s in data.samples]
    every = np.concatenate(token_staleness) if token_staleness else np.zeros(0)
    mixed = sum(len(np.unique(s.versions[s.loss_mask == 1])) > 1 for s in data.samples)
    return {
        "token_staleness_mean": float(every.mean()) if every.size else 0.0,
        "mixed_version_samples": int(mixed),
    }


RATIO_PERCENTILES = (1, 50, 99)


def ratio_percentiles(updates: list[MinibatchStats]) -> dict[str, float]:
    """Min, max and percentiles of the behaviour-proximal ratio pi_prox / pi_behav over every trained token of the
    step (each token counts once, whichever minibatch, micro-batch or rank it was in); {} when not decoupled."""
    parts = [u.values[MISMATCH_LOG_RATIO] for u in updates if MISMATCH_LOG_RATIO in u.values]
    if not parts or not sum(p.size for p in parts):
        return {}
    ratio = np.exp(np.concatenate(parts).astype(np.float64))
    out = {"mismatch/ratio_min": float(ratio.min()), "mismatch/ratio_max": float(ratio.max())}
    for q, value in zip(RATIO_PERCENTILES, np.percentile(ratio, RATIO_PERCENTILES), strict=True):
        out[f"mismatch/ratio_p{q}"] = float(value)
    return out
