"""Gradient synchronisation and clipping for the CPU path (megatron's DDP/optimizer need CUDA).

On GPU, megatron's `finalize_model_grads` and optimizer do the same three things.

- Tensor parallel, Qwen3's q/k layernorms: each TP rank applies the same norm weights to its own heads, so each
  holds part of their gradient; the parts are summed over the TP group (as `finalize_model_grads` does for
  `qk_layernorm`). Every other replicated parameter (the block norms) sees the same input on every TP rank.
- Data parallel: the loss weights are global (the minibatch loss is the SUM over ranks' micro-batch
  losses, see losses.py), so gradients are all-reduced with SUM, not averaged.
- Tied embeddings with pp > 1: the first stage's embedding and the last stage's copy used as output
  layer are one parameter in HF; their gradients are summed over megatron's embedding group so both
  copies take the same optimizer step and stay equal.
- Global norm: each parameter counted once across the model-parallel group: TP-split parameters on
  every TP rank (each holds a different slice), replicated ones (norms) on TP rank 0 only, and the
  last stage's embedding copy not at all. Clipping then matches `torch.nn.utils.clip_grad_norm_` on the
  HF model: coefficient max_norm / (norm + 1e-6), capped at 1.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.trainer.megatron.parallel import Topology


def sync_cpu_grads(
    model: torch.nn.Module, dp_group: Any, embd_group: Any, topo: Topology, tp_group: Any = None
) -> None:
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if topo.tp > 1 and tp_group is not None:
        for name, p in model.named_parameters():
            if p.requires_grad and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=tp_group)  # type: ignore[arg-type]
    if topo.pp > 1 and embd_group is not None and _in_group(embd_group):
        for p in params:
            if getattr(p, "shared_embedding", False):
                dist.all_reduce(p.grad, group=embd_group)
    if topo.dp > 1:
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        dist.all_reduce(flat, group=dp_group)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n


def _in_group(group: Any) -> bool:
    import torch.distributed as dist

    return dist.get_rank(group) >= 0


def clip_global_norm(params: list[torch.nn.Parameter], max_norm: float, mp_group: Any) -> float:
    """Clip in place to the global L2 norm over the model-parallel group; returns the norm before clipping."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None]
    counted = [
        p.grad
        for p in params
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False)
    ]
    total = torch.zeros((), dtype=torch.float64)
    for g in counted:
        total += g.detach().double().pow(2).sum()
    if dist.get_world_size(mp_group) > 1:
        dist.all_reduce(total, group=mp_group)
    norm = float(total.sqrt())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    for g in grads:
        g.mul_(coef)
    return norm
