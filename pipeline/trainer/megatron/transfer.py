"""Moving weights between HF-layout files, megatron parameters and rank 0 (see convert.py for layouts).

Load: every rank opens the HF safetensors lazily and reads only the tensors its shard needs, so no
rank holds the whole model in memory. Export: the ranks of the data-parallel-0 replica gather their
parameters (cast to the checkpoint dtype first, which halves the traffic for bf16) onto global rank 0,
which merges them with `convert.megatron_to_hf`. The result feeds BOTH the HF checkpoint writer and
the weight broadcast to the inference servers (the loop does this), so servers see HF names only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.trainer.megatron.convert import Shard, hf_to_megatron, megatron_to_hf, stage_shard
from pipeline.trainer.megatron.model import ModelDims
from pipeline.trainer.megatron.parallel import Topology


def hf_reader(model_dir: Path) -> Callable[[str], torch.Tensor]:
    """`get(name)` over a HF checkpoint (single file or sharded with an index); tied `lm_head` falls back
    to the embedding, as HF checkpoints of tied models store it once."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (model_dir / "model.safetensors").exists():
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise FileNotFoundError(
            f"{model_dir} has no model.safetensors(.index.json): the megatron backend reads "
            "safetensors checkpoints only (re-save the model with save_pretrained)"
        )

    def get(name: str) -> torch.Tensor:
        if name not in weight_map and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        if name not in weight_map:
            raise KeyError(f"{model_dir}: tensor {name!r} is missing from the checkpoint (not a Qwen2/Llama model?)")
        with safe_open(str(model_dir / weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    return get


def local_shard(dims: ModelDims, topo: Topology) -> Shard:
    return stage_shard(dims, topo.tp_rank, topo.tp, topo.pp_rank, topo.pp)


def load_hf_into(model: torch.nn.Module, model_dir: Path, dims: ModelDims, topo: Topology) -> None:
    """Copy this rank's slice of the HF weights into `model` (names and shapes must match exactly)."""
    tensors = hf_to_megatron(hf_reader(model_dir), dims, local_shard(dims, topo))
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise RuntimeError(
            f"HF -> megatron conversion does not match the model: missing {missing}, unexpected {unexpected}"
        )
    with torch.no_grad():
        for name, param in params.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(param.shape):
                raise RuntimeError(f"{name}: converted shape {tuple(src.shape)} != model shape {tuple(param.shape)}")
            param.copy_(src.to(param.dtype))


def gather_hf(model: torch.nn.Module, dims: ModelDims, topo: Topology, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full HF-named weights on global rank 0 (empty on other ranks). Collective over the model-parallel group
    of data-parallel replica 0; the other replicas hold identical weights and return at once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if topo.dp_rank != 0:
        return {}
    local = {k: v.detach().to("cpu", dtype) for k, v in model.named_parameters()}
    if topo.tp * topo.pp == 1:
        return megatron_to_hf([local], dims, local_shard(dims, topo))
    group = ps.get_model_parallel_group()
    parts: list[Any] | None = [None] * dist.get_world_size(group) if topo.rank == 0 else None
    dist.gather_object(((topo.tp_rank, topo.pp_rank), local), parts, dst=0, group=group)
    if topo.rank != 0:
        return {}
    assert parts is not None
    by_stage: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for (tp_rank, pp_rank), tensors in parts:
        by_stage.setdefault(pp_rank, {})[tp_rank] = tensors
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(topo.pp):
        shards = [by_stage[pp_rank][r] for r in range(topo.tp)]
        out.update(megatron_to_hf(shards, dims, stage_shard(dims, 0, topo.tp, pp_rank, topo.pp)))
    return out
