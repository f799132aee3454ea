"""Process groups for the megatron backend: the default group, megatron's TP/PP/DP groups, seeds.

megatron-core needs `torch.distributed` initialised even for one process, so a lone process gets a
world-size-1 group of its own (gloo on CPU, nccl on GPU) on a free loopback port. Under torchrun
(`WORLD_SIZE` > 1) the usual env:// rendezvous is used. World = tp * pp * dp; megatron's rank
order puts TP innermost, so the TP peers of a rank are neighbours (one node).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.net.addresses import free_port


@dataclass(frozen=True)
class Topology:
    """This rank's place in the (tp, pp, dp) grid."""

    rank: int
    world_size: int
    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    dp_rank: int
    dp: int
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def mp_rank(self) -> int:
        """Rank inside the model-parallel group (the tp * pp ranks holding one copy of the model)."""
        return self.pp_rank * self.tp + self.tp_rank


def init(tp: int, pp: int, device_pref: str, seed: int) -> Topology:
    """Join (or create) the default process group, then megatron's model-parallel groups and RNG seeds."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from pipeline.trainer.megatron import cuda_shim

    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=cpu or auto")
    if not use_cuda and torch.cuda.is_available():
        raise RuntimeError(
            "trainer.device=cpu with the megatron backend on a CUDA machine is not supported "
            "(megatron-core places tensors on the current CUDA device); use trainer.device=auto"
        )
    cuda_shim.apply()  # no-op when CUDA is available
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of trainer.megatron.tp * pp = {tp} * {pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Topology(
        rank=dist.get_rank(),
        world_size=world,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp=tp,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp=pp,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp=parallel_state.get_data_parallel_world_size(),
        device=device,
    )


def groups() -> dict[str, Any]:
    """megatron's process groups this backend uses, by role."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "mp": ps.get_model_parallel_group(),
        "embedding": ps.get_embedding_group(check_initialized=False),
    }


def destroy() -> None:
    """Tear down megatron's groups, the default group and the CUDA shim (a later `init` starts afresh)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pipeline.trainer.megatron import cuda_shim

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    cuda_shim.remove()
