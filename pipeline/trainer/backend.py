"""The trainer backend interface (the factory that picks one by `trainer.backend` is `factory.py`).

A backend owns the model, the optimizer and the scheduler, and runs forward/backward passes.
Everything else is shared and backend-independent: loading and checking the step (`data.py`),
advantages, packing into micro-batches, the loss (`losses.policy_loss`, called by the backend on
flat token tensors), HF-layout checkpoints, the trainer state directory, weight publication and
metrics. A new backend (as megatron did) implements these few methods, converts its weights to
Hugging Face names in `hf_state_dict` and is added to `backends.make_backend`; see docs/trainer.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from pipeline.trainer.losses import LossOutput, TokenBatch
    from pipeline.trainer.packing import MicroBatch

LossFn = Callable[["torch.Tensor", "torch.Tensor | None", "TokenBatch"], "LossOutput"]
"""(log-probs [T], entropy [T] or None, token batch) -> the micro-batch's loss and diagnostics."""


@dataclass
class MinibatchStats:
    """What one optimizer update reports (sums are over this rank's tokens; the loop all-reduces them)."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    """Tokens forwarded (packed rows, prompt included): the throughput numerator."""
    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    """`LossOutput.per_token` concatenated over this rank's micro-batches (the loop gathers them to rank 0)."""


class LossAccumulator:
    """Sums, maxima and per-token values of a minibatch's `LossOutput`s, one `add` per micro-batch: the part of
    `train_minibatch` every backend shares."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.sums: dict[str, float] = defaultdict(float)
        self.maxima: dict[str, float] = defaultdict(lambda: float("-inf"))
        self.values: dict[str, list[torch.Tensor]] = defaultdict(list)

    def add(self, out: LossOutput) -> None:
        self.loss += float(out.loss.detach())
        for k, v in out.sums.items():
            self.sums[k] += float(v)
        for k, v in out.maxima.items():
            self.maxima[k] = max(self.maxima[k], float(v))
        for k, v in out.per_token.items():
            self.values[k].append(v.detach().float().cpu())

    def per_token(self) -> dict[str, np.ndarray]:
        import torch

        return {k: torch.cat(v).numpy() for k, v in self.values.items()}


class TrainBackend(Protocol):
    rank: int
    world_size: int
    num_params: int
    """Parameters of the policy (for MFU: 6 * N * tokens FLOPs per update)."""
    layout: Literal["packed", "padded"]
    """The micro-batch layout the backend's forward takes (`pipeline.trainer.packing`)."""

    def load(self, weights: Path, state: Path | None) -> None:
        """Load HF-layout weights (one version) and, when given, the optimizer/scheduler state saved with
        them (`save_state`'s directory). Called once per process, before any other method."""
        ...

    def logprobs(self, micro: MicroBatch, *, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs [T] (fp32, CPU, no grad) of the current policy, or of the frozen reference
        (loaded only when `kl_coef > 0`)."""
        ...

    def train_minibatch(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> MinibatchStats:
        """Forward/backward each micro-batch summing `loss_fn`'s losses, clip the global grad norm, then one
        optimizer and scheduler step. Collective across data-parallel ranks."""
        ...

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under Hugging Face names, on CPU in the checkpoint dtype, on rank 0 (empty dict on
        other ranks). Collective."""
        ...

    def save_state(self, out_dir: Path) -> None:
        """Write optimizer and scheduler state for exact resume into `out_dir` (rank 0 writes). Collective."""
        ...

    def close(self) -> None:
        """Release the model, optimizer and process group."""
        ...
