"""`cluster:` — Slurm resources per stage (ignored by `--executor local`)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from schemas.config.base import UNSUPPORTED, Block


class StageResources(Block):
    partition: str | None = None
    """Slurm partition (`--partition`)."""
    account: str | None = None
    """Slurm account (`--account`)."""
    qos: str | None = None
    """Slurm QOS (`--qos`)."""
    time_min: int = Field(60, ge=1)
    """Wall-clock limit in minutes (`--time`)."""
    nodes: int = Field(1, ge=1)
    """Nodes for this stage (the trainer runs torchrun on each)."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (`--gpus-per-node`); 0 requests none."""
    cpus_per_task: int = Field(1, ge=1)
    """CPUs per task (`--cpus-per-task`)."""
    mem_gb: int | None = None
    """Memory per node in GB (`--mem`); `None` = the partition default."""
    constraint: str | None = None
    """Node feature constraint (`--constraint`)."""
    nodelist: str | None = None
    """Run on exactly these nodes (`--nodelist`, e.g. `gpu[01-04]`): pins a stage to chosen nodes."""
    exclude: str | None = None
    """Never run on these nodes (`--exclude`), e.g. a node that failed; safe to change on `--resume`."""
    exclusive: bool = False
    """Whole nodes (`--exclusive`)."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` lines, written verbatim (e.g. `--reservation=foo`)."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before the stage (e.g. `module load cuda`, `source venv/bin/activate`)."""


class ClusterConfig(Block):
    inference: StageResources = Field(default_factory=StageResources)
    """Resources of the inference-server job."""
    rollout: StageResources = Field(default_factory=StageResources)
    """Resources of the rollout job (proxy + agents)."""
    proxy: StageResources = Field(default_factory=StageResources)
    """Resources of the standalone proxy job (external agents)."""
    train: StageResources = Field(default_factory=StageResources)
    """Resources of the trainer job."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before every stage (before the stage's own `setup`)."""
    python: str | None = None
    """The interpreter every stage job runs (`python -m pipeline.cli stage ...`): an absolute path as the nodes
    see it, or a name looked up on the node's PATH after the setup lines (`python` when `setup` activates a venv
    the nodes see). `None`: the interpreter that runs `arl launch` (warned about when it lies outside the file
    system of `fileroot`, which every node mounts)."""
    workdir: str | None = None
    """Directory every stage job starts in (`#SBATCH --chdir`); relative paths in the config (model, agent, data)
    resolve from it, for the checks too. `None`: the directory `arl launch` runs in."""
    network_interface: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:@-]+$")
    """Network interface between nodes (e.g. `ib0`, `eth0`) for the trainer's collectives and the weight
    broadcast: exported to every stage as `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME`, and the trainer
    announces this interface's address to the servers. `None` = the interface that routes to the servers."""

    @model_validator(mode="after")
    def _one_node_unless_spanning(self) -> ClusterConfig:
        """srun starts a stage once per node: the trainer (torchrun) and the inference stage (each copy serves its
        node) are made for that; a second rollout or proxy would be a second, independent producer of steps."""
        for stage in ("rollout", "proxy"):
            nodes = getattr(self, stage).nodes
            if nodes > 1:
                raise PydanticCustomError(
                    UNSUPPORTED,
                    "cluster.{stage}.nodes={nodes}: only the trainer and the inference servers span several nodes; "
                    "set cluster.{stage}.nodes=1",
                    {"stage": stage, "nodes": nodes},
                )
        return self
