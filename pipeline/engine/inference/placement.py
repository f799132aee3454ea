"""Where an inference job's servers go: which node of the job, which GPUs of the node.

An inference job may span nodes (`cluster.inference.nodes`): `srun` runs the stage once per node, and
each copy starts `inference.num_servers` servers on its node. Server indices are global across the job
(node rank × servers per node + slot), so log names (`server-<i>...`) never collide on the shared run
dir; registry entries are named `<host>-<port>`, unique already.

On a GPU node each server gets its own devices, `tp_size` of them (one for `hf`), through
`CUDA_VISIBLE_DEVICES`: the slot's slice of the devices Slurm gave the job (its `CUDA_VISIBLE_DEVICES`),
or of `0..gpus_per_node-1`. Servers share the devices only when there are too few to go round.
"""

from __future__ import annotations

import logging
import os

from schemas.config import ArlConfig

log = logging.getLogger("arl.engine.launch")


def node_rank() -> int:
    """This copy's node within a multi-node inference job (`SLURM_NODEID`, set by srun); 0 elsewhere."""
    if int(os.environ.get("SLURM_NNODES", "1") or 1) <= 1:
        return 0
    return int(os.environ.get("SLURM_NODEID", "0") or 0)


def server_indices(config: ArlConfig) -> list[int]:
    """Global indices of the servers this node starts."""
    per_node = config.inference.num_servers
    first = node_rank() * per_node
    return list(range(first, first + per_node))


def gpu_env(config: ArlConfig, index: int) -> dict[str, str]:
    """`CUDA_VISIBLE_DEVICES` for server `index` (global), or {} when the servers need not be told apart."""
    inf = config.inference
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in visible.split(",") if d] if visible else []
    if not devices:
        devices = [str(i) for i in range(config.cluster.inference.gpus_per_node)]
    width = 1 if inf.backend == "hf" else inf.tp_size
    if inf.num_servers <= 1 or not devices or (inf.device == "cpu" and inf.backend == "hf"):
        return {}
    if inf.num_servers * width > len(devices):
        log.warning(
            "%d server(s) x %d GPU(s) each do not fit the %d GPU(s) of this node (%s): they share them",
            inf.num_servers,
            width,
            len(devices),
            ",".join(devices),
        )
        return {}
    slot = index % inf.num_servers
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[slot * width : (slot + 1) * width])}
