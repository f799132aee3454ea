"""Learning-rate schedule: linear warmup, then constant / linear / cosine decay to `min_lr_ratio * lr`.

Counted in optimizer updates (`num_steps * minibatches` in a run), so the schedule is a pure
function of the update index and resumes exactly from the scheduler's saved `last_epoch`.
"""

from __future__ import annotations

import math
from typing import Any

from schemas.config.trainer import OptimizerConfig


def lr_factor(update: int, cfg: OptimizerConfig, total_updates: int) -> float:
    """Multiplier of the peak lr for optimizer update `update` (0-based)."""
    if cfg.warmup_steps > 0 and update < cfg.warmup_steps:
        return (update + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_len = max(total_updates - cfg.warmup_steps - 1, 1)
    progress = min(max(update - cfg.warmup_steps, 0) / decay_len, 1.0)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if cfg.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {cfg.schedule!r}; valid: constant, linear, cosine")


def make_scheduler(optimizer: Any, cfg: OptimizerConfig, total_updates: int) -> Any:
    """A `LambdaLR` following `lr_factor` (its state_dict holds the update count for resume)."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lambda update: lr_factor(update, cfg, total_updates))
