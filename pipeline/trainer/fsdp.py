"""Data parallelism for the torch backend: process group from torchrun's env, FSDP2 sharding, and
the few collectives the loop needs (stat sums, barriers). One process (no `WORLD_SIZE` > 1) needs
no process group at all, so every helper is a no-op there.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards each decoder layer, then the root (which holds
the embeddings and, with tied embeddings, the output layer, so the tie survives sharding).
Gradients are reduce-scattered as an AVERAGE over ranks; the loss weights are global (normalised by
the whole minibatch), so the backend multiplies each loss by the world size to get the SUM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(device_pref: str) -> DistInfo:
    """Join torchrun's process group (nccl on GPU, gloo on CPU) when `WORLD_SIZE` > 1."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=cpu or auto")
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return DistInfo(rank, world, local, device)


def shard_model(model: Any) -> None:
    """Apply FSDP2 to every decoder layer (classes in `model._no_split_modules`), then the root."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise RuntimeError(f"{type(model).__name__} names no decoder-layer classes in _no_split_modules")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def full_state_dict(model: Any, world_size: int) -> dict[str, torch.Tensor]:
    """All weights on CPU: gathered to rank 0 under FSDP (other ranks get {}); a plain copy otherwise."""
    if world_size == 1:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def optimizer_state(model: Any, optimizer: Any, world_size: int) -> dict[str, Any]:
    """Optimizer state keyed by parameter names (full, on rank 0 under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=world_size > 1)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any], world_size: int) -> None:
    """Inverse of `optimizer_state`; under FSDP rank 0's copy is broadcast and re-sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world_size > 1)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)


def all_reduce(values: dict[str, float], op: str = "sum") -> dict[str, float]:
    """Sum (or max) each value over ranks; identity without a process group. Keys must match on all ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return dict(zip(keys, tensor.cpu().tolist(), strict=True))


def gather_arrays(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """On rank 0: each key's arrays from every rank, concatenated in rank order; other ranks keep their own.
    Identity without a process group. Keys may differ between ranks (a rank with no tokens sends none)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(values)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(values, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return dict(values)
    keys = sorted({k for part in gathered for k in part})
    return {k: np.concatenate([part[k] for part in gathered if k in part]) for k in keys}


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_int(value: int) -> int:
    """Rank 0's value on every rank (e.g. the resume version, so ranks never disagree)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def destroy() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
